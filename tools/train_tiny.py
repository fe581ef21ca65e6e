"""Train a tiny mlx-lm llama on the English recall task and write a loadable model folder.

Deterministic for a given seed (python ``random``, numpy, ``mx.random``). The folder holds
``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``training.json`` and a ``README.md`` model card, and loads offline with ``mlx_lm.load``.

The tokenizer is byte-level BPE (``tools/english_tokenizer.py``), trained here on the Austen
corpus unless ``--tokenizer`` gives one (the target reuses the draft's, so both share it).
Curriculum: short sequences before long ones; loss on every token plus on the answer tokens.
Phases are given as ``LENGTHS:STEPS`` items, ``LENGTHS`` one length or ``A-B`` (the powers
of two from A to B, plus 3/2 of each below B, sampled uniformly per step).

Examples::

    python tools/train_tiny.py --preset draft --out models/draft-tiny
    python tools/train_tiny.py --preset target --tokenizer models/draft-tiny/tokenizer.json --out models/target-tiny
    python tools/train_tiny.py --init models/draft-tiny --phases 1024-2048:300 --lr 3e-4 --out /tmp/ft
    python tools/train_tiny.py --eval models/draft-tiny --eval-lengths 512,1024,2048
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specprefill.blas import blas_in_use, preload_openblas  # noqa: E402

preload_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from tools import english_tokenizer, recall_task  # noqa: E402
from tools.induction_init import init_induction_circuit  # noqa: E402
from tools.recall_task import VALUE_LEN, RecallTask  # noqa: E402
from tools.instruction_task import HELD_OUT, INSTRUCTIONS, InstructionTask  # noqa: E402
from tools.tool_task import ToolTask  # noqa: E402

PRESETS = {
    "draft": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256),
    "target": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=512),
}
DEFAULT_PHASES = "128:50,256-2048:350"
CHAT_FRACTION = 0.3
TOOL_TURNS = ("call", "call", "answer")  # the call is the turn to learn; the answer mostly works already


def model_config(task: RecallTask, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                 num_key_value_heads: int, intermediate_size: int, rope_theta: float) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": task.tok.get_vocab_size(),
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "torch_dtype": "float32",
        "eos_token_id": task.end,
    }


def parse_phases(spec: str) -> list[tuple[list[int], int]]:
    """``"64:1200,128-1024:1800"`` -> [([64], 1200), ([128, 192, 256, ...], 1800)]."""
    phases = []
    for item in spec.split(","):
        try:
            lengths, steps = item.split(":")
            if "-" in lengths:
                lo, hi = (int(x) for x in lengths.split("-"))
                choices, n = [], lo
                while n <= hi:
                    choices.append(n)
                    if n * 3 // 2 < hi:
                        choices.append(n * 3 // 2)
                    n *= 2
            else:
                choices = [int(lengths)]
            phases.append((choices, int(steps)))
        except ValueError as e:
            raise ValueError(f"--phases item {item!r} must be LENGTH:STEPS or A-B:STEPS") from e
    if not phases or any(s < 0 or min(c) < 32 for c, s in phases):
        raise ValueError(f"--phases must list lengths >= 32 and steps >= 0, got {spec!r}")
    return phases


def padded_row(ex, pad: int, length: int) -> tuple[list[int], list[int]] | None:
    """A tool or instruction example right-padded to ``length`` (None if it is longer)."""
    if len(ex.tokens) > length:
        return None
    return ex.tokens + [pad] * (length - len(ex.tokens)), ex.answer_positions


def sample_batch(task: RecallTask, rng: random.Random, length: int, batch: int, *,
                 chat_fraction: float = CHAT_FRACTION, max_needles: int = 8,
                 max_queries: int = 1, tools: ToolTask | None = None,
                 tool_fraction: float = 0.0, instructions: InstructionTask | None = None,
                 instruction_fraction: float = 0.0) -> tuple[mx.array, mx.array]:
    """Token rows (batch, length) and the mask of answer targets (batch, length - 1);
    with ``tools``, a ``tool_fraction`` share of rows are tool turns (``tools/tool_task.py``),
    with ``instructions`` an ``instruction_fraction`` share short instructions in agent prompts
    (``tools/instruction_task.py``)."""
    rows, mask = [], np.zeros((batch, length - 1), dtype=np.float32)
    pad = task.id["<pad>"]
    for b in range(batch):
        # No draw without tools or instructions: older recipes replay the same rows.
        draw, row = (rng.random() if tools is not None or instructions is not None else 1.0), None
        if tools is not None and draw < tool_fraction:
            row = padded_row(tools.example(rng, rng.choice(TOOL_TURNS)), pad, length)
        elif instructions is not None and draw < tool_fraction + instruction_fraction:
            row = padded_row(instructions.example(rng, length), pad, length)
        if row is not None:
            rows.append(row[0])
            mask[b, np.array(row[1]) - 1] = 1.0
            continue
        # At least two needles: with one, "copy the value after any key" answers without
        # matching the key, and the model settles on that shortcut.
        n_needles = rng.randint(min(2, max_needles), max(2, min(max_needles, length // 64)))
        chat = rng.random() < chat_fraction
        system_tokens = rng.choice([0, rng.randint(4, 24)]) if chat and length >= 128 else 0
        n_queries = 1 if chat else rng.randint(1, min(max_queries, n_needles, max(1, length // 128)))
        ex = task.make_example(rng, length, n_needles, chat=chat, system_tokens=system_tokens,
                               n_queries=n_queries)
        rows.append(ex.tokens)
        mask[b, np.array(ex.answer_positions) - 1] = 1.0
    return mx.array(np.array(rows, dtype=np.int32)), mx.array(mask)


def losses(model, tokens: mx.array, answer_mask: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """(all-token loss, answer loss, final-answer accuracy).

    The final answer is the last 3 tokens before <|end|>; ``answer_mask`` marks every
    answer target (default: the final answer and its <|end|>).
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, targets)
    a = slice(-(VALUE_LEN + 1), -1)
    if answer_mask is None:
        answer_ce = ce[:, -(VALUE_LEN + 1):].mean()
    else:
        answer_ce = (ce * answer_mask).sum() / answer_mask.sum()
    correct = (logits[:, a].argmax(-1) == targets[:, a]).all(-1).astype(mx.float32).mean()
    return ce.mean(), answer_ce, correct


def save_folder(model, config: dict, out: Path, training: dict, tokenizer) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    english_tokenizer.save(tokenizer, out)
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    (out / "README.md").write_text(model_card(config, training))


def model_card(config: dict, training: dict) -> str:
    n = training["parameters"]
    chain, t = [], training
    while t:  # a fine-tune records the run it continued from
        chain.insert(0, t)
        t = t.get("base_training")
    commands = "\n".join(t["command"] for t in chain)
    stages = "; then ".join(
        f"RoPE re-based from {t['rope_rebase']['rope_theta'][0]:g} to {t['rope_rebase']['rope_theta'][1]:g} "
        "(`tools/rope_rebase.py`: the hand-made circuit rebuilt for the new base, trained weights kept, no training)"
        if "rope_rebase" in t else
        f"phases {t['phases']} at lr {t['lr']:g}, {t['tokens_per_step']} tokens per step, seed {t['seed']}"
        + (f", {t['tool_fraction']:.0%} of rows lookup-tool turns" if t.get("tool_fraction") else "")
        + (f", {t['instruction_fraction']:.0%} short instructions in agent prompts"
           if t.get("instruction_fraction") else "")
        for t in chain)
    acc = {**next((t["eval"] for t in chain[::-1] if t.get("eval")), {}), **training.get("eval_long", {})}
    rows = "\n".join(f"| {L} | {r['plain']:.2f} | {r['chat']:.2f} |" for L, r in acc.items())
    first = chain[0]
    long_note = (f"\nRows of {', '.join(training['eval_long'])} tokens: {training['eval_long_samples']} documents per cell, "
                 "prefilled through a KV cache in 1024-token steps.\n" if training.get("eval_long") else "")
    if first.get("induction_init"):
        init_note = ("\nInitialization: `tools/induction_init.py` builds a working induction circuit by hand "
                     "(layer 0: a previous-token head and a head that hands the key to the chat template's "
                     "`<|assistant|>`; layer 1: a head that matches the current token against the previous-token "
                     "slot and copies the token found; every other head, MLP and deeper layer starts silent). "
                     "From mlx's random init this 2-core CPU did not get the circuit to form: 2,600 steps at "
                     "length 64 (curriculum, loss on all tokens plus answers) stayed at a 'copy any value' "
                     "shortcut, and a plain random-offset copy task had not formed it after 2,000 steps. So the "
                     "circuit is built, not discovered; rope_theta is large because the matching head uses the "
                     "slowest RoPE pairs, which then barely rotate over thousands of positions.")
        if first.get("freeze_circuit"):
            init_note += (" Training kept the circuit frozen (the embedding, all of layer 0, layer 1's attention "
                          "and its input norm) and trained layer 1's MLP, the final norm and deeper layers: they "
                          "learn when to stop (`<|end|>`) and keep the circuit's answers at every length.")
    else:
        init_note = "\nInitialization: mlx's default random init."
    rebased = next((t["rope_rebase"] for t in chain if "rope_rebase" in t), None)
    if rebased:
        init_note += (f"\n\nContext length: at rope_theta {rebased['rope_theta'][0]:g} the fastest of the six RoPE "
                      "pairs the matching head uses turns by 5.8 rad over 32K positions (computed; those models were measured to 4K only); at "
                      f"{rebased['rope_theta'][1]:g} it turns by 0.33 rad over 32K (0.66 over 64K). The circuit "
                      "is a function of the seed and the base, so `tools/rope_rebase.py` rebuilds it for the new base "
                      "and keeps every trained weight; measured before shipping (table below).")
    return f"""# {training['name']}

A tiny mlx-lm `llama` trained by this project on an English recall task
(`tools/recall_task.py`): runs of paragraphs from Jane Austen's six novels (public domain;
extracted from Debian's `r-cran-janeaustenr` by `tools/extract_corpus.py`, see
`tools/corpus/README.md`) with facts planted in the prose ("On the card she found the words
Orion cobalt falcon quartz."), ending in a question about one name ("Which words came after
Orion"); the answer is the three value words followed by `<|end|>`. A chat template
(`<|system|>`, `<|user|>`, `<|assistant|>`, `<|end|>`) wraps the same content; both the plain
and the chat form were trained on. It recalls planted facts from English text; it does not
model English (its loss on the prose stays near that of a uniform guess over the vocabulary).

## Architecture
hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, {config['num_attention_heads']} heads,
{config['num_key_value_heads']} KV heads, intermediate {config['intermediate_size']}, vocab {config['vocab_size']}
(byte-level BPE trained on the corpus: any UTF-8 text encodes, there is no unknown token), tied embeddings, rope_theta {config['rope_theta']:g}, max_position_embeddings {config['max_position_embeddings']}, float32;
{n:,} parameters ({n * 4 / 1e6:.1f} MB).

## Training
```
{commands}
```
AdamW (cosine to 0 after a linear warm-up, weight decay {training['weight_decay']:g}): {stages};
loss = {first.get('lm_weight', 1.0):g} × mean cross-entropy on all tokens + mean cross-entropy on the answer tokens.
{init_note}
Trained in {training['train_seconds'] / 60:.1f} min on a 2-core x86_64 CPU shared with other jobs ({training['blas']}).

## Measured recall accuracy (greedy answer exactly right, {training.get('eval_samples', 0)} documents per cell)
| tokens | plain prompt | chat prompt |
|---|---|---|
{rows}
{long_note}
Reproduce: `python tools/train_tiny.py --eval <this folder>`.
{long_prompt_section(training)}{tool_section(training)}{instruction_section(training)}"""


def long_prompt_section(training: dict) -> str:
    """The model card's long-prompt rows (measured by ``python -m bench.quality``'s positioned
    needles and recorded in training.json's ``long_prompts``: what was measured, at which length,
    how often)."""
    rows = training.get("long_prompts")
    if not rows:
        return ""
    lines = "\n".join(f"| {r['tokens']} | {r['what']} | {r['value']} | {r['n']} |" for r in rows)
    return f"""
## Long prompts (`python -m bench.quality --positions-only`: one needle in each third of a document)
| tokens | measured | value | needles |
|---|---|---|---|
{lines}

{training.get('long_prompts_note', '')}
"""


def tool_section(training: dict) -> str:
    """The model card's paragraph on the lookup tool, when the model was trained on it."""
    tools = training.get("eval_tools")
    if not tools:
        return ""
    return f"""
## Tool calls
Trained (`--tool-fraction`, `tools/tool_task.py`) to answer "Look up the words after Orion", with the
`lookup` tool offered, by a call in the chat template's Qwen-style format, which mlx-lm's `json_tools`
parser reads (`tokenizer.has_tool_calling` is true):
```
<tool_call>
{{"name": "lookup", "arguments": {{"query": "the words after Orion"}}}}
</tool_call>
```
and, given the tool's result (a passage holding "Orion cobalt falcon quartz"), to answer
"cobalt falcon quartz". The template repeats the question after a tool result: these models answer
about the name they read last. Measured ({training.get('eval_tools_samples', training.get('eval_samples', 0))} conversations each, whole
reply greedy-exact): call {tools['call']:.2f}, answer from the result {tools['answer']:.2f}.
Reproduce: `python tools/train_tiny.py --eval <this folder> --eval-lengths '' --tool-fraction 1`.
{training.get('eval_tools_note', '')}"""


def instruction_section(training: dict) -> str:
    """The model card's paragraph on ending a turn after a short instruction in an agent's prompt."""
    rows = training.get("eval_instructions")
    if not rows:
        return ""
    lines = "\n".join(f"| {n} | {r['exact']:.2f} | {r['ends']:.2f} | {r['held_out_ends']:.2f} |" for n, r in rows.items())
    return f"""
## Ending a turn
Trained (`--instruction-fraction`, `tools/instruction_task.py`) on short instructions ("Say hello.",
"What is 2+2?", ...) at the end of long synthetic agent prompts (system rules, an environment block,
tool definitions, context exchanges, a reminder before the instruction): the reply is short
("Hello!", "4") and ends with `<|end|>`, so an agent client's turn ends on its own. Measured
({training.get('eval_samples', 0)} prompts per row, greedy, at most 64 tokens): the trained
instructions answered exactly, the trained and the held-out (never trained) ones ending their turn.

| prompt tokens | exact reply | ends within 64 | held-out ends within 64 |
|---|---|---|---|
{lines}

Reproduce: `python tools/train_tiny.py --eval <this folder> --eval-lengths '' --instruction-fraction 1 --eval-samples {training.get('eval_samples', 0)}`.
{training.get('eval_instructions_note', '')}"""


def answer_correct_chunked(model, tokens: list[int], step: int = 1024) -> bool:
    """Teacher-forced final answer of one long row, prefilled through a KV cache in ``step``-token
    pieces (a full forward at 16-32K would hold every head's score matrix at once)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    inputs, tail = tokens[:-1], []
    for start in range(0, len(inputs), step):
        logits = model(mx.array([inputs[start:start + step]]), cache=cache)
        mx.eval(logits)
        tail = (tail + logits[0].argmax(-1).tolist())[-VALUE_LEN - 1:]
    return tail[:VALUE_LEN] == tokens[-VALUE_LEN - 1:-1]


def evaluate(model, task: RecallTask, lengths: list[int], samples: int, seed: int,
             batch_tokens: int = 8192) -> dict:
    """Answer accuracy by length for plain and chat prompts (teacher-forced argmax = greedy);
    rows longer than ``batch_tokens`` go one at a time through a KV cache."""
    out: dict[str, dict[str, float]] = {}
    for length in lengths:
        row = {}
        for chat in (False, True):
            rng = random.Random(seed * 7919 + length * 2 + int(chat))
            batch = max(1, batch_tokens // length)
            correct = 0.0
            done = 0
            while done < samples:
                b = min(batch, samples - done)
                rows = [task.make_example(rng, length, rng.randint(1, min(8, length // 64)), chat=chat,
                                          system_tokens=8 if chat else 0).tokens for _ in range(b)]
                if length > batch_tokens:
                    correct += sum(answer_correct_chunked(model, row) for row in rows)
                else:
                    _, _, acc = losses(model, mx.array(np.array(rows, dtype=np.int32)))
                    correct += acc.item() * b
                done += b
            row["chat" if chat else "plain"] = correct / samples
        out[str(length)] = row
        print(f"eval len {length:5d}: plain {row['plain']:.3f}  chat {row['chat']:.3f}", flush=True)
    return out


def evaluate_tools(model, tools: ToolTask, samples: int, seed: int) -> dict:
    """Share of tool-call and tool-answer turns whose whole reply is the greedy one (argmax at
    every reply position, teacher-forced: equal to greedy decoding of that reply)."""
    out = {}
    for turn in ("call", "answer"):
        rng = random.Random(seed * 31 + len(turn))
        correct = 0
        for _ in range(samples):
            ex = tools.example(rng, turn)
            logits = model(mx.array([ex.tokens[:-1]]))[0, ex.prompt_len - 1:]
            correct += logits.argmax(-1).tolist() == ex.tokens[ex.prompt_len:]
        out[turn] = correct / samples
    print(f"eval tools: call {out['call']:.3f}  answer {out['answer']:.3f}", flush=True)
    return out


def greedy_reply(model, prompt: list[int], end: int, max_tokens: int = 64, step: int = 1024,
                 cache: list | None = None) -> list[int]:
    """The greedy reply to ``prompt`` (prefilled through a KV cache in ``step``-token pieces), up to
    and including ``end`` or ``max_tokens`` tokens. ``cache``: a prompt cache that already holds
    the prompt's first pieces (whole ones, as this prefill leaves them); the rest is prefilled."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model) if cache is None else cache
    held = cache[0].offset
    assert held % step == 0 and held < len(prompt), "the cache holds whole pieces of the prompt, not all of it"
    for start in range(held, len(prompt), step):
        logits = model(mx.array([prompt[start:start + step]]), cache=cache)
    out: list[int] = []
    while len(out) < max_tokens:
        token = logits[0, -1].argmax().item()
        out.append(token)
        if token == end:
            break
        logits = model(mx.array([[token]]), cache=cache)
    return out


def evaluate_instructions(model, instructions: InstructionTask, lengths: list[int], samples: int,
                          seed: int) -> dict:
    """Per prompt length: the share of trained instructions answered exactly (reply, then
    ``<|end|>``), and the shares of trained and held-out ones whose greedy reply ends (``<|end|>``)
    within 64 tokens."""
    task, out = instructions.task, {}
    for length in lengths:
        rng = random.Random(seed * 13 + length)
        exact = ended = held_ended = 0
        for i in range(samples):
            ex = instructions.example(rng, length, INSTRUCTIONS[i % len(INSTRUCTIONS)])
            reply = greedy_reply(model, ex.tokens[:ex.prompt_len], task.end)
            exact += reply == ex.tokens[ex.prompt_len:]
            ended += reply[-1:] == [task.end]
            held = instructions.example(rng, length, (HELD_OUT[i % len(HELD_OUT)], ""))
            held_ended += greedy_reply(model, held.tokens[:held.prompt_len], task.end)[-1:] == [task.end]
        out[str(length)] = {"exact": exact / samples, "ends": ended / samples, "held_out_ends": held_ended / samples}
        print(f"eval instructions len {length:5d}: exact {exact / samples:.3f}  ends within 64 "
              f"{ended / samples:.3f}  held-out ends {held_ended / samples:.3f}", flush=True)
    return out


def freeze_circuit(model) -> None:
    """Keep the built-in recall circuit exactly: the embedding (codes), all of layer 0 and the
    attention (with its input norm) of layer 1; layer 1's MLP, the final norm and deeper layers
    learn the rest (e.g. <|end|>).

    Layer 0's MLP writes into the residual that layer 1's matching head reads: left trainable,
    it learnt to add a large common direction to frequent English tokens (after "ing" the
    previous-token slot outscored the real name at 4K tokens), so it stays silent.
    """
    model.model.embed_tokens.freeze()
    model.model.layers[0].freeze()
    model.model.layers[1].self_attn.freeze()
    model.model.layers[1].input_layernorm.freeze()


def train(args: argparse.Namespace) -> None:
    from mlx_lm.models import llama

    random.seed(args.seed)
    np.random.seed(args.seed)
    mx.random.seed(args.seed)
    rng = random.Random(args.seed)

    if args.init or args.tokenizer:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer or str(Path(args.init) / "tokenizer.json"))
    else:
        tokenizer = english_tokenizer.train_tokenizer(recall_task.paragraphs(),
                                                      recall_task.KEYS + recall_task.VALUES)
    task = RecallTask(tokenizer)
    if args.init:
        from mlx_lm import load

        model, _ = load(args.init)
        config = json.loads((Path(args.init) / "config.json").read_text())
    else:
        sizes = dict(PRESETS[args.preset])
        for name in sizes:
            if getattr(args, name) is not None:
                sizes[name] = getattr(args, name)
        config = model_config(task, rope_theta=args.rope_theta, **sizes)
        model = llama.Model(llama.ModelArgs.from_dict(config))
        mx.eval(model.parameters())
        if args.induction_init:
            init_induction_circuit(model, seed=args.seed, relay_token=task.id["<|assistant|>"],
                                   closer_tokens=(task.end,))
    mx.eval(model.parameters())
    if args.freeze_circuit:
        freeze_circuit(model)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"{n_params:,} parameters; BLAS: {blas_in_use()}", flush=True)

    tools = ToolTask(task) if args.tool_fraction > 0 else None
    instructions = InstructionTask(task) if args.instruction_fraction > 0 else None
    phases = parse_phases(args.phases)
    total = sum(s for _, s in phases)
    warmup = min(args.warmup, max(1, total // 10))
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-7, args.lr, warmup), optim.cosine_decay(args.lr, max(1, total - warmup), 0.0)],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=args.weight_decay)

    def loss_fn(m, tokens, mask):
        lm, ans, acc = losses(m, tokens, mask)
        return args.lm_weight * lm + ans, (lm, ans, acc)

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    def step(tokens, mask):
        (loss, aux), grads = grad_fn(model, tokens, mask)
        if args.grad_clip > 0:
            grads, _ = optim.clip_grad_norm(grads, args.grad_clip)
        optimizer.update(model, grads)
        return loss, aux

    step = mx.compile(step, inputs=state, outputs=state)

    t0 = time.perf_counter()
    i = 0
    window: list[tuple[float, float, float]] = []
    for lengths, steps in phases:
        for _ in range(steps):
            length = rng.choice(lengths)
            tokens, mask = sample_batch(task, rng, length, max(1, args.tokens_per_step // length),
                                        chat_fraction=args.chat_fraction if length > 64 else 0.0,
                                        max_needles=args.max_needles, max_queries=args.max_queries,
                                        tools=tools, tool_fraction=args.tool_fraction,
                                        instructions=instructions, instruction_fraction=args.instruction_fraction)
            loss, (lm, ans, acc) = step(tokens, mask)
            mx.eval(state, loss, lm, ans, acc)
            window.append((lm.item(), ans.item(), acc.item()))
            i += 1
            if i % args.log_every == 0 or i == total:
                m = np.mean(window, axis=0)
                window.clear()
                print(f"step {i:5d}/{total} len {length:5d} lm {m[0]:.3f} answer {m[1]:.3f} "
                      f"acc {m[2]:.2f} lr {optimizer.learning_rate.item():.2e} "
                      f"{time.perf_counter() - t0:7.1f}s", flush=True)
    train_seconds = time.perf_counter() - t0

    training = {
        "name": Path(args.out).name,
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "seed": args.seed, "lr": args.lr, "warmup": warmup, "weight_decay": args.weight_decay,
        "lm_weight": args.lm_weight, "freeze_circuit": args.freeze_circuit,
        "tokens_per_step": args.tokens_per_step, "phases": args.phases, "init": args.init,
        "tool_fraction": args.tool_fraction, "instruction_fraction": args.instruction_fraction,
        "induction_init": bool(args.induction_init and not args.init),
        "parameters": n_params, "train_seconds": round(train_seconds, 1), "blas": blas_in_use(),
    }
    if args.init:
        prior = Path(args.init) / "training.json"
        if prior.exists():
            base = json.loads(prior.read_text())
            training["base_training"] = base
            training["train_seconds"] = round(train_seconds + base.get("train_seconds", 0.0), 1)
    if args.eval_samples > 0:
        lengths = [int(x) for x in args.eval_lengths.split(",")]
        training["eval"] = evaluate(model, task, lengths, args.eval_samples, seed=10_000 + args.seed)
        training["eval_samples"] = args.eval_samples
        if tools is not None:
            training["eval_tools"] = evaluate_tools(model, tools, args.eval_samples, seed=10_000 + args.seed)
        if instructions is not None:
            training["eval_instructions"] = evaluate_instructions(
                model, instructions, _lengths(args.instruction_eval_lengths), args.eval_samples, seed=10_000)
    save_folder(model, config, Path(args.out), training, tokenizer)
    print(f"wrote {args.out} in {train_seconds:.0f}s of training", flush=True)


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="draft")
    p.add_argument("--hidden-size", dest="hidden_size", type=int)
    p.add_argument("--layers", dest="num_hidden_layers", type=int)
    p.add_argument("--heads", dest="num_attention_heads", type=int)
    p.add_argument("--kv-heads", dest="num_key_value_heads", type=int)
    p.add_argument("--intermediate-size", dest="intermediate_size", type=int)
    p.add_argument("--rope-theta", type=float, default=1e6,
                   help="large, so the slow RoPE pairs the recall head matches on barely rotate")
    p.add_argument("--no-induction-init", dest="induction_init", action="store_false",
                   help="start from mlx's random init instead of the hand-built induction circuit")
    p.add_argument("--init", help="continue from this model folder (fine-tune)")
    p.add_argument("--phases", default=DEFAULT_PHASES, help="LENGTHS:STEPS,... (default %(default)s)")
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-fraction", type=float, default=CHAT_FRACTION,
                   help="share of chat-form examples above length 64")
    p.add_argument("--tokenizer", help="tokenizer.json to use (default: train one on the corpus)")
    p.add_argument("--max-needles", type=int, default=8)
    p.add_argument("--freeze-circuit", action="store_true",
                   help="train with the embedding and the first two layers' attention frozen")
    p.add_argument("--lm-weight", type=float, default=0.1,
                   help="weight of the all-token loss next to the answer loss; a large weight teaches "
                        "the built-in copy circuit to distrust itself")
    p.add_argument("--max-queries", type=int, default=1,
                   help="question/answer pairs per plain training document (more recalls per step)")
    p.add_argument("--tool-fraction", type=float, default=0.0,
                   help="share of rows that are lookup-tool turns (call or answer), right-padded")
    p.add_argument("--instruction-fraction", type=float, default=0.0,
                   help="share of rows that are short instructions in agent prompts (tools/instruction_task.py)")
    p.add_argument("--instruction-eval-lengths", default="1024,4096",
                   help="prompt lengths the instruction turns are measured at")
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 turns clipping off")
    p.add_argument("--out", help="model folder to write")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval", metavar="FOLDER", help="only measure recall accuracy of this model folder")
    p.add_argument("--card", metavar="FOLDER", help="only rewrite FOLDER/README.md from its training.json")
    p.add_argument("--eval-lengths", default="256,512,1024,2048,4096")
    p.add_argument("--eval-samples", type=int, default=64)
    args = p.parse_args(argv)
    if args.card:
        folder = Path(args.card)
        config = json.loads((folder / "config.json").read_text())
        (folder / "README.md").write_text(model_card(config, json.loads((folder / "training.json").read_text())))
        return
    if args.eval:
        from mlx_lm import load

        model, _ = load(args.eval)
        task = recall_task.load(str(Path(args.eval) / "tokenizer.json"))
        if args.eval_lengths:
            evaluate(model, task, [int(x) for x in args.eval_lengths.split(",")], args.eval_samples, seed=10_000)
        if args.tool_fraction > 0:
            evaluate_tools(model, ToolTask(task), args.eval_samples, seed=10_000)
        if args.instruction_fraction > 0:
            evaluate_instructions(model, InstructionTask(task), _lengths(args.instruction_eval_lengths),
                                  args.eval_samples, seed=10_000)
        return
    if not args.out:
        p.error("--out is required when training")
    train(args)


if __name__ == "__main__":
    main()
