"""Load time of a draft whose config has a far position threshold: the far probe with and without a prefill.

A ministral3-shaped draft (yarn rope with ``original_max_position_embeddings``, the query scale
past it, a sliding layer) is probed the way a worker verifies a draft at load
(``worker.models.draft_profiler`` runs ``specprefill.profile.profile_model``, whose kernel probe
runs at positions 0-7 and again just past the threshold). Before, the far probe prefilled every position up to the threshold
(``specprefill_testkit/far_prefix.py``, kept as the reference); now its caches are filled with
random keys through their own updates (``specprefill.attention.probe.synthetic_prefix``). Both
run side by side in one process, alternating; the profiles must be equal.

    .venv/bin/python -m bench.far_probe [--threshold 16384] [--hidden 256] [--repeats 2] [--quick]
"""
from __future__ import annotations

import argparse
import time

from bench.benchlib import parse_quick, verdict
import specprefill_testkit.families as F
from specprefill_testkit.far_prefix import prefill_prefix


def ministral3_draft(threshold: int, hidden: int):
    """The family's tiny config widened to ``hidden`` with its threshold at ``threshold`` positions."""
    args = F.FAMILIES["ministral3"].args
    rope = dict(args["rope_parameters"], original_max_position_embeddings=threshold)
    return F.build("ministral3", seed=3, hidden_size=hidden, intermediate_size=2 * hidden,
                   num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 128), head_dim=32,
                   rope_parameters=rope, max_position_embeddings=4 * threshold)


def probe_time(model, far_prefix) -> tuple[float, object]:
    """Seconds of the kernel probe of a draft (what a worker's draft verification spends), and its profile."""
    from specprefill.attention.probe import probe_attention

    started = time.perf_counter()
    profile = probe_attention(model, far_prefix=far_prefix)
    return time.perf_counter() - started, profile


def main(argv=None) -> int:
    from specprefill.attention.probe import synthetic_prefix
    from specprefill.profile import profile_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threshold", type=int, default=16384, help="original_max_position_embeddings")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parse_quick(parser, argv, "seconds: threshold 2048, hidden 64, one repeat",
                       threshold=2048, hidden=64, repeats=1)
    model = ministral3_draft(args.threshold, args.hidden)
    times = {"prefill": [], "synthetic": []}
    profiles = {}
    for _ in range(args.repeats):
        for name, prefix in (("prefill", prefill_prefix), ("synthetic", synthetic_prefix)):
            seconds, profiles[name] = probe_time(model, prefix)
            times[name].append(seconds)
    before, after = min(times["prefill"]), min(times["synthetic"])
    started = time.perf_counter()
    profile_model(model)  # the whole draft verification a worker runs at load, now
    whole = time.perf_counter() - started
    print(f"ministral3-shaped draft, hidden {args.hidden}, original_max_position_embeddings {args.threshold}, "
          f"best of {args.repeats}")
    print("| far probe starts with | kernel probe at load (s) |\n|---|---|")
    print(f"| a prefill of {args.threshold + 1} tokens (before) | {before:.2f} |")
    print(f"| synthetic keys, no forward pass (now) | {after:.2f} |")
    print(f"whole draft verification now (specprefill.profile.profile_model): {whole:.2f} s")
    passed = verdict("far_probe_load_speedup", before / after, ">=", 2.0 if args.quick else 20.0, f"{before / after:.1f}x")
    passed &= verdict("far_probe_profiles_equal", int(profiles["prefill"] == profiles["synthetic"]), ">=", 1)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
