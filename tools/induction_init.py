"""Start a tiny llama with a working induction circuit (structured initialization).

Recall ("? kXX" -> the value after the earlier kXX) needs an induction circuit: a first-layer
head that copies each token's predecessor into its residual stream, and a second-layer head
that finds the position whose predecessor is the current token and copies that position's
token. Trained from a random start on this 2-core CPU, the tiny models sat for thousands of
steps on the "copy any token seen in context" plateau before that circuit formed (a random-
offset copy task did not learn in 2,000 steps either). So the circuit is built by hand and
training then adapts everything; the model stays a plain mlx-lm ``llama`` and every weight
stays trainable.

Residual stream layout (``d`` = hidden size, ``hd`` = head dim):

* ``[0, n_code)``: a token's identity code, 512 well-spread unit vectors;
* ``[n_code, d - hd - CONST_DIMS)``: the rest of the (random) token embedding;
* a ``hd``-dimensional "previous token" slot, zero in every embedding row;
* ``CONST_DIMS`` dimensions holding one constant vector shared by every token.

With tied embeddings the constant adds the same logit to every token and the slot none.

Layer 0, head 0 reads only the constant direction for its query and key, so its score depends
on relative position alone; RoPE-aware vectors make it peak at the previous token. Its value
carries the token code, its output writes it into the slot. Layer 1, head 0 compares the
current token's code (query) with the slot (key) and copies the attended token's embedding
(value/output). Queries and keys of the matching head use only the slowest-rotating RoPE
pairs, so matching holds over thousands of positions; that is why these models use a large
``rope_theta``. All other heads, the MLPs and deeper layers start silent (zero output
projection) and are grown by training.
"""
from __future__ import annotations

import hashlib
import math

import mlx.core as mx
import numpy as np

CONST_DIMS = 8
N_SLOW_PAIRS = 6        # RoPE pairs used to match codes: 12 code dimensions
PREV_MARGIN = 14.0      # softmax-scale score gap of the previous-token head at Δ=1
MATCH_GAIN = 40.0       # softmax-scale score of a perfect code match
COPY_GAIN = 4.0         # size of the copied embedding against the token's own
OUTPUT_SCALE = 0.4      # final norm weight: keeps the first logits soft (tied rows have norm ~1.7)


def _rope_scores(vq: np.ndarray, vk: np.ndarray, theta: float, max_delta: int) -> np.ndarray:
    """Score of a constant q at position m against a constant k at m - Δ, for Δ in [0, max_delta].

    Rotated by ``mx.fast.rope`` itself, so the sign convention is mlx's own.
    """
    n, dims = max_delta + 1, vq.size
    keys = mx.fast.rope(mx.array(np.tile(vk, (1, 1, n, 1)).astype(np.float32)), dims,
                        traditional=False, base=theta, scale=1.0, offset=0)
    query = mx.fast.rope(mx.array(vq.reshape(1, 1, 1, dims).astype(np.float32)), dims,
                         traditional=False, base=theta, scale=1.0, offset=max_delta)
    return np.array((keys * query).sum(-1)).reshape(n)[::-1]


def previous_token_vectors(head_dim: int, theta: float, max_delta: int, delta: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Unit-scale (q, k) whose RoPE score is highest at ``delta`` over Δ in [0, max_delta]."""
    half = head_dim // 2
    weights = np.exp(-np.arange(half) / 2.0)  # the fast-rotating pairs make the peak sharp
    angles = theta ** (-np.arange(half) * 2.0 / head_dim)
    vq = np.concatenate([np.sqrt(weights), np.zeros(half)])
    for sign in (1.0, -1.0):  # k pre-rotated by delta steps; which way depends on the convention
        a = angles * delta
        vk = np.concatenate([np.sqrt(weights) * np.cos(a), sign * np.sqrt(weights) * np.sin(a)])
        if int(np.argmax(_rope_scores(vq, vk, theta, max_delta))) == delta:
            return vq, vk
    raise RuntimeError(f"RoPE convention not recognised: no peak at Δ={delta}")


def _positional_head(vq_dir: np.ndarray, c_hat: np.ndarray, hd: int, theta: float, max_delta: int,
                     delta: int, unit: float) -> tuple[np.ndarray, np.ndarray]:
    """(q rows, k rows) of a head attending ``delta`` back; q reads ``vq_dir``, k the constant."""
    vq, vk = previous_token_vectors(hd, theta, max_delta, delta)
    s = _rope_scores(vq, vk, theta, max_delta) * hd ** -0.5
    gap = s[delta] - np.max(np.delete(s, delta))
    amp = math.sqrt(PREV_MARGIN / gap) / unit
    return amp * np.outer(vq, vq_dir), amp * np.outer(vk, c_hat)


# Repelled codes by their start: a pure function of it, a minute on 2 CPUs for a 2048-token
# vocabulary, so every build in one process (the tests build the same circuits several
# times) repels a given start once.
_SPREAD: dict[tuple[bytes, tuple[int, ...], int], np.ndarray] = {}


def spread_codes(n: int, dims: int, rng: np.random.Generator, steps: int = 300) -> np.ndarray:
    """``n`` unit vectors in ``dims`` dimensions pushed apart (soft repulsion)."""
    z = rng.normal(size=(n, dims))  # drawn every call: the caller's generator moves on alike
    key = (hashlib.sha256(z.tobytes()).digest(), z.shape, steps)
    if key not in _SPREAD:
        _SPREAD[key] = _repel(z, steps)
    return _SPREAD[key].copy()


def _repel(z: np.ndarray, steps: int) -> np.ndarray:
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
    for _ in range(steps):
        g = z @ z.T
        np.fill_diagonal(g, -np.inf)
        w = np.exp(8.0 * (g - g.max(axis=1, keepdims=True)))
        w /= w.sum(axis=1, keepdims=True)
        z -= 0.2 * (w @ z)
        z /= np.linalg.norm(z, axis=1, keepdims=True)
    return z


def _silence(layer) -> None:
    """Zero every head's output projection and the MLP's down projection of ``layer``."""
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)


def init_induction_circuit(model, *, seed: int, relay_token: int | None = None, closer_tokens: tuple[int, ...] = (),
                           max_delta: int = 8192) -> None:
    """Rewrite ``model`` (an mlx-lm llama with >= 2 layers) in place; see the module doc."""
    args = model.args
    d, layers = args.hidden_size, model.model.layers
    hd = layers[0].self_attn.head_dim
    n_code = 2 * N_SLOW_PAIRS
    if len(layers) < 2 or hd < n_code + 8 or d < hd + CONST_DIMS + n_code + hd or \
            (relay_token is not None and layers[0].self_attn.n_heads < 3):
        raise ValueError(f"model too small for the induction circuit: hidden {d}, head_dim {hd}, layers {len(layers)}")
    rng = np.random.default_rng(seed)
    code = slice(0, n_code)
    rest = slice(n_code, d - CONST_DIMS - hd)
    slot0 = d - CONST_DIMS - hd
    const = slice(d - CONST_DIMS, d)
    half = hd // 2
    slow = list(range(half - N_SLOW_PAIRS, half)) + list(range(hd - N_SLOW_PAIRS, hd))  # head dims

    # Embedding: code + random rest (same size each) + zero slot + shared constant.
    vocab = args.vocab_size
    emb = np.zeros((vocab, d))
    emb[:, code] = spread_codes(vocab, n_code, rng)
    n_rest = rest.stop - rest.start
    emb[:, rest] = rng.normal(size=(vocab, n_rest)) / math.sqrt(n_rest)
    c = rng.normal(size=CONST_DIMS)
    emb[:, const] = c / np.linalg.norm(c)
    scale = 1.0  # RMSNorm makes the overall embedding scale irrelevant to attention
    model.model.embed_tokens.weight = mx.array((emb * scale).astype(np.float32))
    # RMSNorm(x) = x * sqrt(d) / |x|; every row has |x|^2 = 3 (code, rest, constant: 1 each).
    unit = math.sqrt(d / 3.0)

    for layer in layers:
        _silence(layer)

    # Layer 0, head 0: previous-token head writing the predecessor's code into the slot.
    a0 = layers[0].self_attn
    c_hat = np.zeros(d)
    c_hat[const] = c / np.linalg.norm(c)
    wq, wk = np.array(a0.q_proj.weight), np.array(a0.k_proj.weight)
    wv, wo = np.array(a0.v_proj.weight), np.zeros(a0.o_proj.weight.shape)
    wq[:hd], wk[:hd] = _positional_head(c_hat, c_hat, hd, args.rope_theta, max_delta, 1, unit)
    wv[:hd] = 0.0
    for j, h in enumerate(slow):
        wv[h, j] = 1.0 / unit            # value = the predecessor's code, unit size
        wo[slot0 + h, h] = 1.0           # written into the slot at the same head dims
    if relay_token is not None:
        # Layer 0, head 2: the relay token (a chat template's generation prompt, which follows
        # "key <|end|>") takes the code of the token two back as its own, so the induction
        # step answers right after the template's closers. Other tokens' queries are ~0
        # there: a near-uniform average of codes, a small perturbation.
        # One "gate" dimension, non-zero only in the relay token's row: only it queries.
        gate = rest.start
        emb[:, gate] = 0.0
        emb[relay_token, code] = 0.0
        emb[relay_token, rest] = 0.0
        emb[relay_token, gate] = math.sqrt(2.0)  # keeps |row|^2 = 3
        # The template closer between key and relay ("? kXX <|end|> <|assistant|>") would
        # hold the key's code in its slot and match the query itself; without the constant
        # component its previous-token query is zero, so its slot gets only a faint average.
        for t in closer_tokens:
            emb[t, const] = 0.0
            emb[t, rest] *= math.sqrt(2.0)
        model.model.embed_tokens.weight = mx.array(emb.astype(np.float32))
        r_hat = np.zeros(d)
        r_hat[gate] = 1.0
        head, kv = 2, 2 // (a0.n_heads // a0.n_kv_heads)
        if kv == 0:
            raise ValueError("the relay head needs a second KV head")
        q_rows, k_rows = _positional_head(r_hat, c_hat, hd, args.rope_theta, max_delta, 2, unit * math.sqrt(2.0))
        wq[head * hd:(head + 1) * hd], wk[kv * hd:(kv + 1) * hd] = q_rows, k_rows
        wv[kv * hd:(kv + 1) * hd] = 0.0
        for j in range(n_code):
            wv[kv * hd + j, j] = 1.0 / unit
            wo[j, head * hd + j] = 1.0
    a0.q_proj.weight, a0.k_proj.weight = mx.array(wq.astype(np.float32)), mx.array(wk.astype(np.float32))
    a0.v_proj.weight, a0.o_proj.weight = mx.array(wv.astype(np.float32)), mx.array(wo.astype(np.float32))

    # Layer 1, head 0: match the current code against the slot, copy the attended token.
    # After layer 0 a row is |x|^2 ~ 4 (the slot adds a unit code); RMSNorm scales by sqrt(d/4).
    unit1 = math.sqrt(d / 4.0)
    a1 = layers[1].self_attn
    wq, wk = np.array(a1.q_proj.weight), np.array(a1.k_proj.weight)
    wv, wo = np.array(a1.v_proj.weight), np.zeros(a1.o_proj.weight.shape)
    wq[:hd] = 0.0
    wk[:hd] = 0.0
    g = math.sqrt(MATCH_GAIN * math.sqrt(hd))
    for j, h in enumerate(slow):
        wq[h, j] = g / unit1                 # current token's code
        wk[h, slot0 + h] = g / unit1         # predecessor's code, from the slot
    wv[:hd] = 0.0
    basis = np.zeros((hd, d))
    basis[:n_code, code] = np.eye(n_code)
    extra = np.linalg.qr(rng.normal(size=(n_rest, hd - n_code)))[0].T
    basis[n_code:, rest] = extra
    wv[:hd] = basis / unit1
    wo[:, :hd] = COPY_GAIN * basis.T
    a1.q_proj.weight, a1.k_proj.weight = mx.array(wq.astype(np.float32)), mx.array(wk.astype(np.float32))
    a1.v_proj.weight, a1.o_proj.weight = mx.array(wv.astype(np.float32)), mx.array(wo.astype(np.float32))
    # Without this the untrained circuit predicts every filler word with confidence (loss ~9 on
    # unpredictable tokens), and the first large gradients undo the circuit.
    model.model.norm.weight = mx.full(model.model.norm.weight.shape, OUTPUT_SCALE)
    mx.eval(model.parameters())
