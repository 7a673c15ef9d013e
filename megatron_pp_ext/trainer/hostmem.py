"""Does the model of a local CPU run fit in this machine's memory? Checked in the parent before
any process starts.

A model far too large for the machine (``--hidden 4000000``: 64 TB for one weight matrix) used to
fail on every worker with an allocator traceback (or thrash the machine). The check is a lower
bound, so it never refuses a run that fits: every parameter once (split over the pipeline and
tensor ranks, repeated on every data-parallel rank; the multi-token prediction layers too) with its
fp32 weight, gradient and two Adam moments (16 bytes), plus one microbatch's activations of one layer (the attention scores of
Megatron-Core's local layers, s x s per head, included).
"""

from __future__ import annotations

__all__ = ["available_bytes", "lower_bound_bytes", "check_fits"]

_BYTES_PER_PARAM = 16     # fp32 weight, gradient, Adam exp_avg and exp_avg_sq


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None (then nothing is checked)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def lower_bound_bytes(c, *, layers: int, kv_heads: int, ffn: int, dp: int) -> dict[str, float]:
    """The parts of the lower bound, by the flag that sizes them most (bytes)."""
    h, v, s, b, a = c.hidden, c.vocab, c.seq, c.micro_batch_size, c.heads
    mlp = (3 if c.model == "llama" else 2) * h * ffn
    if c.num_experts:
        mlp = c.num_experts * (3 if c.model == "llama" else 2) * h * (c.moe_ffn_hidden_size or ffn)
    per_layer = h * (h + 2 * kv_heads * (h // max(1, a))) + h * h + mlp
    embed = v * h * (1 if c.tie_embeddings else 2) + (s * h if c.model == "gpt" else 0)
    act = b * (34 * s * h + 4 * a * s * s)           # one layer, one microbatch, fp32
    mtp = getattr(c, "mtp_num_layers", None) or 0     # each: a layer and its 2h x h projection
    model = (f"--hidden {h}, --layers {layers}" + (f", --num-experts {c.num_experts}" if c.num_experts else "")
             + (f", --mtp-num-layers {mtp}" if mtp else ""))
    return {model: float((layers * per_layer + mtp * (per_layer + 2 * h * h)) * _BYTES_PER_PARAM * dp),
            f"--vocab {v}": float(embed * _BYTES_PER_PARAM * dp), f"--seq {s}": float(act)}


def check_fits(c, *, layers: int, kv_heads: int, ffn: int, dp: int, fail) -> None:
    """``fail(message)`` when the lower bound exceeds the memory available here."""
    have = available_bytes()
    if have is None:
        return
    parts = lower_bound_bytes(c, layers=layers, kv_heads=kv_heads, ffn=ffn, dp=dp)
    need = sum(parts.values())
    if need <= have:
        return
    flags = max(parts, key=parts.get)
    fail(f"{flags}: the model does not fit this machine's memory: it needs at least {_gib(need)} (weights, gradients "
         f"and Adam state of every local process, and one layer's activations) and {_gib(have)} is available; lower "
         f"{' or '.join(f.split()[0] for f in flags.split(', '))}, or use GPUs")


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**50 else f"{n / 2**50:,.3g} PiB"
