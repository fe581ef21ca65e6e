"""Re-base a shipped tiny model's RoPE: rebuild its hand-made circuit for a new ``rope_theta``.

The recall circuit of the shipped models (``tools/induction_init.py``) is a function of the
seed and ``rope_theta``: layer 0's positional heads are pre-rotated for that base, and layer 1's
matching head uses the slowest-rotating RoPE pairs, which at base 1e6 turn by 5.8 rad over 32K
positions (the match fades there). This script builds the circuit afresh for a larger base
(every frozen weight: the embedding, layer 0, layer 1's attention and input norm) and keeps the
trained weights of the folder (layer 1's MLP, the final norm, deeper layers), then writes a new
folder with ``rope_theta`` and ``max_position_embeddings`` updated. Measure the copy
(``tools/train_tiny.py --eval``) before shipping it; a short fine-tune (``--init``) can follow.

    python tools/rope_rebase.py models/draft-tiny --rope-theta 1e8 --max-positions 65536 --out /tmp/draft-1e8
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specprefill.blas import preload_openblas  # noqa: E402

preload_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from tools import recall_task  # noqa: E402
from tools.induction_init import init_induction_circuit  # noqa: E402

# Weights the circuit builder writes and training kept frozen (train_tiny.freeze_circuit).
CIRCUIT_PREFIXES = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.self_attn.",
                    "model.layers.1.input_layernorm.")
BASE_DEPENDENT = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight")


def circuit_weights(config: dict, seed: int, tokenizer_path: Path) -> dict[str, mx.array]:
    """The frozen circuit's weights built for ``config`` (its ``rope_theta``)."""
    from mlx_lm.models import llama

    task = recall_task.load(str(tokenizer_path))
    mx.random.seed(seed)  # as train_tiny does: the heads the builder leaves alone keep mlx's init
    model = llama.Model(llama.ModelArgs.from_dict(config))
    init_induction_circuit(model, seed=seed, relay_token=task.id["<|assistant|>"], closer_tokens=(task.end,),
                           max_delta=config["max_position_embeddings"])
    return {k: v for k, v in tree_flatten(model.parameters()) if k.startswith(CIRCUIT_PREFIXES)}


def rebase(folder: Path, out: Path, rope_theta: float, max_positions: int) -> dict:
    """Write ``out``: ``folder``'s trained weights with the circuit rebuilt for ``rope_theta``."""
    config = json.loads((folder / "config.json").read_text())
    training = json.loads((folder / "training.json").read_text())
    first = training
    while first.get("base_training"):
        first = first["base_training"]
    seed = first["seed"]
    new_config = {**config, "rope_theta": rope_theta, "max_position_embeddings": max_positions}
    circuit = circuit_weights(new_config, seed, folder / "tokenizer.json")
    weights = mx.load(str(folder / "model.safetensors"))
    # Only layer 0's positional heads depend on the base: every other circuit weight must be the
    # folder's own, or the folder was not built (or not frozen) as this script assumes.
    same = [k for k in circuit if k not in BASE_DEPENDENT or rope_theta == config["rope_theta"]]
    drift = max(float(mx.abs(weights[k] - circuit[k]).max()) for k in same)
    if drift > 1e-6:
        raise ValueError(f"{folder}: its circuit is not the one seed {seed} builds (max diff {drift:g})")
    weights.update(circuit)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, out / name)
    record = {"name": out.name, "command": "python " + " ".join(sys.argv), "rope_rebase": {
        "from": folder.name, "rope_theta": [config["rope_theta"], rope_theta],
        "max_position_embeddings": [config["max_position_embeddings"], max_positions]}, **{
        k: training[k] for k in ("seed", "lr", "weight_decay", "tokens_per_step", "phases", "parameters",
                                 "train_seconds", "blas", "lm_weight", "freeze_circuit", "init", "induction_init")
        if k in training}, "base_training": training}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return new_config


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--rope-theta", type=float, required=True)
    p.add_argument("--max-positions", type=int, required=True, help="max_position_embeddings of the copy")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    rebase(args.folder, args.out, args.rope_theta, args.max_positions)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
