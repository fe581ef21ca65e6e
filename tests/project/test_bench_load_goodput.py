"""bench.load's goodput (issue 39): per TTFT SLO, as ``vllm bench serve --goodput`` counts it, and
the agent trace's target never an infinite ratio from a peer with no goodput at the stated SLO."""
import math

from bench.load import PEER, Run, agent_target
from bench.load_client import Record, goodput_name, summarize

OURS = "batching+SpecPrefill"


def _records(ttfts: list[float], key: str = "agent") -> list[Record]:
    """One record per TTFT, sent one second apart, each ending one second after its first token."""
    return [Record(f"{key}-{i}", sent=float(i), first=i + t, chunks=[i + t], done=i + t + 1.0, output_tokens=4)
            for i, t in enumerate(ttfts)]


def _run(ours: list[float], peer: list[float], slos=(2.0, 5.0, 10.0, 30.0)) -> Run:
    return Run(records={("agent", "8", OURS): _records(ours), ("agent", "8", PEER): _records(peer)}, slos=slos)


def test_goodput_counts_the_requests_within_each_slo_per_second():
    records = _records([0.5, 3.0, 12.0, 40.0])  # duration: sent at 0, the last done at 3 + 40 + 1
    s = summarize(records, (1.0, 5.0, 60.0))
    assert s[goodput_name(1.0)] == 1 / 44 and s[goodput_name(5.0)] == 2 / 44 and s[goodput_name(60.0)] == 4 / 44
    assert goodput_name(2.0) == "goodput@2s"


def test_agent_target_at_the_stated_slo_when_the_peer_meets_it():
    name, value, op, bound, shown = agent_target(_run([1.0, 1.0, 1.0, 1.0], [1.0, 20.0, 20.0, 20.0]), OURS, "", 10.0)
    assert name == "agent_trace_goodput_vs_mlx_lm" and (op, bound) == (">=", 2.0)
    assert math.isclose(value, 4.0 * (3 + 20 + 1) / (3 + 1 + 1)) and "TTFT <= 10 s" in shown


def test_agent_target_moves_to_the_tightest_slo_where_the_peer_has_goodput_and_says_so():
    value, shown = agent_target(_run([1.0] * 4, [20.0] * 4), OURS, "", 5.0)[1::3]
    assert math.isfinite(value) and "taken at 30 s" in shown and "peer's is 0 at 5 s" in shown


def test_agent_target_at_the_peers_fastest_turn_when_its_goodput_is_0_at_every_slo_and_says_so():
    value, shown = agent_target(_run([1.0, 1.0, 1.0, 40.0], [50.0, 60.0, 70.0, 80.0]), OURS, "", 10.0)[1::3]
    # At 50 s: all 4 of ours over their 3 + 40 + 1 s, 1 of the peer's over its 3 + 80 + 1 s.
    assert math.isclose(value, (4 / 44) / (1 / 84)) and "TTFT <= 50 s" in shown
    assert "0 at every SLO of the sweep (10 to 30 s)" in shown and "fastest turn" in shown


def test_agent_target_has_no_ratio_when_the_peer_did_no_turn():
    run = _run([1.0] * 4, [])
    run.records[("agent", "8", PEER)] = [Record("agent-0", sent=0.0, error="APIError: boom")]
    value, shown = agent_target(run, OURS, "", 10.0)[1::3]
    assert math.isnan(value) and shown.startswith("no ratio")
