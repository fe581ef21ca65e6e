"""A heal turn's prefill over a plain turn's, on the shipped tiny target and on a 7B-shaped layer.

``bench/conversation.py`` measures ``heal_turn_ttft_vs_plain`` on the shipped tiny target, which
is attention-bound (4 layers of 8 heads on a 256-wide model): there a heal turn's time follows
the query-key pairs its new tokens attend over, not the tokens it prefills. This script times,
side by side in one run, the two prefills that ratio compares, at the shapes of that trace's
middle turn (turn 6: a plain turn prefills 15844 tokens on the restored 4349-token system
prefix, a heal turn 1697 tokens on 18496 restored), through the service's own prefill loop
(``specprefill.prefill.run_prefill``, the settings' step, the last token alone), on:

- ``shipped``: the shipped target, its own weights;
- ``7b``: ``--layers`` layers of a Llama-2-7B-shaped llama (4096 wide, 32 heads, 8 KV heads as
  in 7-8B GQA models, MLP 11008) with random weights: a real target's balance of per-token work
  (projections, MLP) against attention. A prefill's time does not depend on the weights' values,
  and layers add alike to both prefills, so its ratio is that of a whole model of this shape.
  A prefill evaluates only the cache, so the last layer's attention and MLP are never computed
  (the heal's last token, which goes alone, is computed whole): with the default 2 layers one
  layer does all the work, as each of a 32-layer model's does.

The restored cache holds random K/V of the right shape (restoring is not what is timed). TTFT
only: no answers, no recall (those are ``bench/conversation.py``'s, on the shipped pair). This is
the ``heal-plain`` way of that bench (a tool result prefilled in full on the healed conversation);
its ``heal`` way scores and sparsely prefills the tool result instead. The target per model: a
heal turn's prefill costs no more than its exact share of the plain turn's work, the larger of its
tokens ratio (per-token work) and its attention pairs ratio (attention), within 10%: the heal
path adds nothing to the prefill of what is new.

    .venv/bin/python -m bench.heal_shapes [--models shipped 7b] [--layers 2]
    .venv/bin/python -m bench.heal_shapes --quick     # seconds: small shapes
"""
import argparse
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from bench.benchlib import SETTINGS, parse_quick, report
from jobs.settings import SHIPPED_MODELS
from specprefill.prefill import run_prefill
from specprefill_testkit.tiny_models import make_model


SEVEN_B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=8,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               vocab_size=2048)  # the shipped tokenizer's (the vocabulary only sizes the embedding)


def load_model(name: str, layers: int):
    if name == "shipped":
        from mlx_lm import load
        return load(str(SHIPPED_MODELS / "target-tiny"))[0]
    return make_model("llama", num_hidden_layers=layers, **SEVEN_B)


def restored_cache(model, tokens: int) -> list:
    """A cache holding ``tokens`` positions of random K/V, as a restore leaves it."""
    cache = make_prompt_cache(model)
    args = model.args
    heads, dim = args.num_key_value_heads, args.hidden_size // args.num_attention_heads
    for c in cache:
        c.update_and_fetch(mx.random.normal((1, heads, tokens, dim)), mx.random.normal((1, heads, tokens, dim)))
    mx.eval([c.state for c in cache])
    return cache


def timed_prefill(model, restored: int, new: int, step: int) -> float:
    cache = restored_cache(model, restored)
    inputs = mx.random.randint(0, model.args.vocab_size, (new,))
    mx.eval(inputs)
    t = time.perf_counter()
    run_prefill(model, inputs, cache, first_stop=0, step=step, progress=None)
    return time.perf_counter() - t


def pairs(restored: int, new: int) -> int:
    return new * restored + new * (new + 1) // 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["shipped", "7b"], choices=["shipped", "7b"])
    p.add_argument("--layers", type=int, default=2, help="layers of the 7B shape (the last one only writes its cache)")
    p.add_argument("--plain", type=int, nargs=2, default=[4349, 15844], metavar=("RESTORED", "NEW"))
    p.add_argument("--heal", type=int, nargs=2, default=[18496, 1697], metavar=("RESTORED", "NEW"))
    p.add_argument("--step", type=int, default=SETTINGS.prefill_step)
    args = parse_quick(p, argv, "seconds: small shapes",
                       plain=[256, 1024], heal=[1152, 128], step=512)
    return args


def main() -> int:
    args = parse_args()
    (pr, pn), (hr, hn) = args.plain, args.heal
    tokens_ratio, pairs_ratio = hn / pn, pairs(hr, hn) / pairs(pr, pn)
    share = max(tokens_ratio, pairs_ratio)  # the heal's exact share of the plain turn's work
    print(f"plain turn: {pn} tokens prefilled on {pr} restored; heal turn: {hn} on {hr}; step {args.step}; "
          f"tokens ratio {tokens_ratio:.3f}, attention pairs ratio {pairs_ratio:.3f}")
    print("| target | plain s | heal s | heal / plain |")
    print("|---|---:|---:|---:|")
    verdicts = []
    for name in args.models:
        model = load_model(name, args.layers)
        timed_prefill(model, 64, 64, args.step)  # compile
        plain, heal = timed_prefill(model, pr, pn, args.step), timed_prefill(model, hr, hn, args.step)
        label = "shipped tiny target" if name == "shipped" else f"7B-shaped llama, {args.layers} layer(s)"
        print(f"| {label} | {plain:.2f} | {heal:.2f} | {heal / plain:.3f} |")
        verdicts.append((f"heal_prefill_over_exact_share_{name}", heal / plain / share, "<=", 1.1))
        del model
        mx.clear_cache()
    return report([], verdicts)


if __name__ == "__main__":
    sys.exit(main())
