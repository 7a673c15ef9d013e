"""Layer-level checks of vocabulary parallelism against the unsharded computation.

:func:`run_layer_cases` runs on every rank of a pp*tp world (e.g. a
:class:`~megatron_pp_ext.runtime.pool.WorkerPool` configuration): for each :class:`LayerCase`
it builds the shards from full weights, drives the passes of a few microbatches (all partial
embeddings, the first stage's embedding forward and backward, the last stage's hand-off, all S
passes, all T passes, the losses and their backward, the embedding gradients: several
microbatches in flight on every channel) and returns what it computed. :func:`reference_case`
computes the same in float64 without sharding; :func:`compare_case` gathers the shards and
returns the relative errors of every microbatch loss, of the input gradients and of the
weight gradients.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch

from ..features.vocab.config import VocabParallelConfig, VocabPartition

__all__ = ["LayerCase", "run_layer_cases", "reference_case", "compare_case", "case_data"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LayerCase:
    algorithm: int = 2
    tied: bool = False
    label_smoothing: float = 0.0
    dtype: str = "fp32"
    pp: int = 4
    tp: int = 1
    vocab: int = 50
    hidden: int = 16
    mbs: int = 2
    seq: int = 5
    microbatches: int = 4
    forward_only: bool = False
    input_embedding: bool = True
    last_on_first: bool = False    # the last stage on pipeline rank 0 (the V placement)
    seed: int = 7

    @property
    def name(self) -> str:
        return (f"alg{self.algorithm}-{'tied' if self.tied else 'untied'}-ls{self.label_smoothing:g}-{self.dtype}"
                f"-pp{self.pp}tp{self.tp}-V{self.vocab}" + ("-fwd" if self.forward_only else "")
                + ("" if self.input_embedding else "-noemb") + ("-V" if self.last_on_first else ""))


def _gen(case: LayerCase, what: str) -> torch.Generator:
    d = hashlib.sha256(f"{case.seed}:{what}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(d[:8], "little") & ((1 << 63) - 1))


def case_data(case: LayerCase) -> dict:
    """Deterministic full weights (float64, rounded to the case dtype) and microbatches."""
    dt = _DTYPES[case.dtype]
    V, h = case.vocab, case.hidden

    def rnd(shape, what, scale):
        return (scale * torch.randn(*shape, generator=_gen(case, what), dtype=torch.float64)).to(dt).double()

    w_out = rnd((V, h), "w_out", 0.5)
    w_emb = w_out if case.tied else rnd((V, h), "w_emb", 0.5)
    mbs = []
    for m in range(case.microbatches):
        g = _gen(case, f"mb{m}")
        tokens = torch.randint(0, V, (case.mbs, case.seq), generator=g)
        labels = torch.randint(0, V, (case.mbs, case.seq), generator=g)
        mask = (torch.rand(case.mbs, case.seq, generator=g) < 0.7).double()
        if m == 1:
            mask[:, ::2] = 0.0          # masked tokens in every microbatch, many in this one
        x = rnd((case.seq, case.mbs, h), f"x{m}", 1.0)
        r = rnd((case.mbs, case.seq, h), f"r{m}", 1.0)   # first stage: loss = sum(emb * r)
        mbs.append({"tokens": tokens, "labels": labels, "mask": mask, "x": x, "r": r})
    return {"w_out": w_out, "w_emb": w_emb, "mbs": mbs}


def _loss_grad(case: LayerCase, mask: torch.Tensor) -> torch.Tensor:
    """g = d(sum(L * mask) / count * scale) / dL: what Megatron's per-token loss hands back."""
    count = max(mask.sum().item(), 1.0)
    return mask * (0.5 / count)


def run_layer_cases(cases: list[LayerCase]) -> list[dict]:
    """On every rank of a world of pp*tp ranks (the same for all cases): run each case."""
    import torch.distributed as dist

    from ..features.vocab.parallel import VocabGroups, VocabParallel

    groups: dict = {}
    out = []
    for case in cases:
        world = dist.get_world_size()
        if case.pp * case.tp != world:
            raise ValueError(f"case {case.name} needs {case.pp * case.tp} ranks, the world has {world}")
        key = (case.pp, case.tp, case.last_on_first)
        if key not in groups:
            groups[key] = VocabGroups.from_grid(case.pp, case.tp, last_pp=0 if case.last_on_first else -1)
        grp = groups[key]
        dt = _DTYPES[case.dtype]
        data = case_data(case)
        cfg = VocabParallelConfig(algorithm=case.algorithm, label_smoothing=case.label_smoothing,
                                  input_embedding=case.input_embedding)
        eng = VocabParallel(cfg, case.vocab, case.hidden, grp, tied=case.tied, dtype=dt)
        eng.shards.load_full(data["w_out"].to(dt), None if case.tied else data["w_emb"].to(dt))
        M = case.microbatches
        mbs = data["mbs"]
        train = not case.forward_only
        try:
            rec: dict = {"case": asdict(case), "shard": grp.shard, "pp_rank": grp.pp_rank, "tp_rank": grp.tp_rank,
                         "losses": [], "x_grads": [], "param_bytes": sum(p.numel() * p.element_size()
                                                                         for p in eng.shards.parameters())}
            eng.begin_iteration(M, case.mbs, case.seq, tokens=[mb["tokens"] for mb in mbs], forward_only=not train)
            if case.input_embedding:
                for m in range(M):
                    eng.emb_forward(m)
                if grp.is_first:
                    embs = []
                    for m in range(M):
                        eng.emb_input(m)
                        e = eng.embedding_output(mbs[m]["tokens"])
                        embs.append(e.detach().double().clone())
                        if train:
                            (e.double() * mbs[m]["r"]).sum().backward()
                    rec["embeddings"] = embs
            xs = []
            if grp.is_last:
                for m in range(M):
                    x = mbs[m]["x"].to(dt).requires_grad_(train)
                    xs.append(x)
                    g = _loss_grad(case, mbs[m]["mask"]).float() if train else None
                    eng.hand_off(m, x, mbs[m]["labels"], g)
            for m in range(M):
                eng.s_pass(m)
            if train and case.algorithm == 1:
                for m in range(M):
                    eng.t_pass(m)
            if grp.is_last:
                for m in range(M):
                    L = eng.loss(m)
                    rec["losses"].append(L.detach().double().clone())
                    if train:
                        mask = mbs[m]["mask"].to(L.dtype)
                        total = (L * mask).sum() / max(mask.sum().item(), 1.0) * 0.5
                        total.backward()
                        rec["x_grads"].append(xs[m].grad.double().clone())
            if train and case.algorithm == 2:
                for m in range(M):
                    eng.t_pass(m)
            if train and case.input_embedding:
                for m in range(M):
                    eng.emb_backward(m)
            eng.end_iteration()
            sh = eng.shards
            rec["out_grad"] = None if sh.output_weight.grad is None else sh.output_weight.grad.double().clone()
            w_in = sh.input_weight
            rec["emb_grad"] = (None if (w_in is None or sh.tied or w_in.grad is None) else w_in.grad.double().clone())
            rec["out_weight"] = sh.output_weight.detach().double().clone()
            out.append(rec)
        finally:
            eng.close()
    return out


def reference_case(case: LayerCase) -> dict:
    """The unsharded computation in float64: losses, input gradients, weight gradients."""
    from ..features.vocab.kernels import reference_loss

    data = case_data(case)
    V = case.vocab
    w_out = data["w_out"].clone().requires_grad_(True)
    w_emb = w_out if case.tied else data["w_emb"].clone().requires_grad_(True)
    losses, x_grads, embs = [], [], []
    for mb in data["mbs"]:
        x = mb["x"].clone().requires_grad_(True)
        n = x.shape[0] * x.shape[1]
        target = mb["labels"].t().reshape(-1)
        L = reference_loss(x.reshape(n, -1), w_out, target, V, case.label_smoothing)
        L = L.double().view(case.seq, case.mbs).t()
        losses.append(L.detach())
        if not case.forward_only:
            g = _loss_grad(case, mb["mask"])
            (L * g).sum().backward()
            x_grads.append(x.grad.detach())
        if case.input_embedding:
            e = w_emb[mb["tokens"]]
            embs.append(e.detach())
            if not case.forward_only:
                (e * mb["r"]).sum().backward()
    return {"losses": losses, "x_grads": x_grads, "embeddings": embs,
            "out_grad": None if case.forward_only else w_out.grad.detach(),
            "emb_grad": None if (case.forward_only or case.tied or not case.input_embedding) else w_emb.grad.detach(),
            "w_out": data["w_out"]}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def compare_case(case: LayerCase, per_rank: list[dict]) -> dict:
    """Gather the shards of ``per_rank`` (records of one case, one per rank) and compare with
    :func:`reference_case`. Returns the worst relative errors (keys: loss, x_grad, out_grad,
    emb_grad, embedding) and the per-rank parameter bytes."""
    ref = reference_case(case)
    P = case.pp * case.tp
    recs = sorted(per_rank, key=lambda r: r["shard"])
    assert [r["shard"] for r in recs] == list(range(P)), "one record per shard expected"
    err = {"loss": 0.0, "x_grad": 0.0, "out_grad": 0.0, "emb_grad": 0.0, "embedding": 0.0, "weights": 0.0}
    last = [r for r in recs if r["pp_rank"] == (0 if case.last_on_first else case.pp - 1)]
    assert last, "no record of the last stage"
    for r in last:   # every tp rank of the last stage has the loss and the input gradient
        assert len(r["losses"]) == case.microbatches
        for got, want in zip(r["losses"], ref["losses"]):
            err["loss"] = max(err["loss"], (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30))
        for got, want in zip(r["x_grads"], ref["x_grads"]):
            err["x_grad"] = max(err["x_grad"], _rel(got, want))
    if case.input_embedding:
        for r in (r for r in recs if r["pp_rank"] == 0):
            for got, want in zip(r["embeddings"], ref["embeddings"]):
                err["embedding"] = max(err["embedding"], _rel(got, want))
    V = case.vocab
    part = VocabPartition(V, P, 0)
    full_w = torch.cat([r["out_weight"] for r in recs])
    err["weights"] = _rel(full_w[:V], ref["w_out"])
    if any(part.of(i).valid_rows < part.rows and full_w[part.of(i).start + part.of(i).valid_rows:
                                                        part.of(i).stop].abs().max() > 0 for i in range(P)):
        raise AssertionError("padding rows of the shards are not zero")
    if not case.forward_only:
        got = torch.cat([r["out_grad"] for r in recs])
        err["out_grad"] = _rel(got[:V], ref["out_grad"])
        if got[V:].numel() and got[V:].abs().max() > 0:
            raise AssertionError("padding rows got a gradient")
        if ref["emb_grad"] is not None:
            got = torch.cat([r["emb_grad"] for r in recs])
            err["emb_grad"] = _rel(got[:V], ref["emb_grad"])
    err["param_bytes"] = [r["param_bytes"] for r in recs]
    return err


# --- checkpoints ------------------------------------------------------------------------------

def checkpoint_case(directory: str, mode: str, pp: int, tp: int, vocab: int = 50, hidden: int = 8,
                    tied: bool = False, seed: int = 3) -> dict:
    """On every rank of a pp*tp world: ``mode="save"``: shards from seeded full weights, one Adam
    step (so the optimizer has row-wise moments and a step count), save; ``mode="load"``: load
    (at this world's sharding). Returns this rank's rows and optimizer state."""
    from ..features.vocab.checkpoint import load_optimizer_row_state, load_vocab_checkpoint, optimizer_row_state, save_vocab_checkpoint
    from ..features.vocab.parallel import VocabGroups, VocabParallel

    groups = VocabGroups.from_grid(pp, tp)
    eng = VocabParallel(VocabParallelConfig(), vocab, hidden, groups, tied=tied)
    try:
        g = torch.Generator().manual_seed(seed)
        w_out = torch.randn(vocab, hidden, generator=g)
        w_emb = w_out if tied else torch.randn(vocab, hidden, generator=g)
        params = [p for p in eng.shards.parameters()]
        opt = torch.optim.Adam(params, lr=0.1)
        if mode == "save":
            eng.shards.load_full(w_out, None if tied else w_emb)
            for p in params:
                p.grad = torch.ones_like(p) * (1 + eng.part.shard)
            opt.step()
            rows, other = optimizer_row_state(opt, eng)
            save_vocab_checkpoint(directory, eng, row_state=rows, other_state=other)
            loaded = None
        else:
            loaded = load_vocab_checkpoint(directory, eng, with_row_state=True)
            load_optimizer_row_state(opt, eng, loaded)
        state = {}
        for which, p in (("output", eng.shards.output_weight), ("embedding", getattr(eng.shards, "embedding_weight", None))):
            if p is not None and p in opt.state:
                state[which] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
        return {"shard": eng.part.shard, "start": eng.part.start, "valid": eng.part.valid_rows,
                "rows": {k: v.detach().clone() for k, v in _tensors_of(eng).items()}, "opt": state,
                "resharded": None if loaded is None else loaded["resharded"]}
    finally:
        eng.close()


def _tensors_of(eng) -> dict:
    out = {"output": eng.shards.output_weight}
    if eng.shards.input_embedding and not eng.shards.tied:
        out["embedding"] = eng.shards.embedding_weight
    return out


def gather_rows(per_rank: list[dict], which: str, vocab: int, key=None) -> torch.Tensor:
    """The full [vocab, ...] tensor from per-rank records (rows, or an optimizer state ``key``)."""
    parts = []
    for r in sorted(per_rank, key=lambda r: r["shard"]):
        t = r["rows"][which] if key is None else r["opt"][which][key]
        parts.append(t[:r["valid"]])
    return torch.cat(parts)[:vocab]


def misuse_messages() -> dict[str, str]:
    """On a world of one rank: the error message of each misuse of the passes (no collective is
    involved, so nothing can hang)."""
    from ..features.vocab.parallel import VocabGroups, VocabParallel

    groups = VocabGroups.from_grid(1, 1)
    case = LayerCase(pp=1, tp=1)
    data = case_data(case)
    mbs = data["mbs"]
    out: dict[str, str] = {}

    def attempt(name, fn):
        eng = VocabParallel(VocabParallelConfig(algorithm=2), case.vocab, case.hidden, groups)
        eng.shards.load_full(data["w_out"].float(), data["w_emb"].float())
        try:
            fn(eng)
            out[name] = ""
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[name] = f"{type(e).__name__}: {e}"
        finally:
            eng.close()

    def begin(eng, **kw):
        eng.begin_iteration(case.microbatches, case.mbs, case.seq, tokens=[mb["tokens"] for mb in mbs], **kw)

    def nonlinear(eng):
        begin(eng)
        x = mbs[0]["x"].float().requires_grad_(True)
        g = _loss_grad(case, mbs[0]["mask"]).float()
        eng.hand_off(0, x, mbs[0]["labels"], g)
        eng.s_pass(0)
        L = eng.loss(0)
        (L ** 2 * mbs[0]["mask"].float()).sum().backward()

    def out_of_order(eng):
        begin(eng)
        eng.hand_off(1, mbs[1]["x"].float(), mbs[1]["labels"], None)

    def wrong_ids(eng):
        begin(eng)
        eng.emb_forward(0)
        eng.emb_input(0)
        eng.embedding_output(mbs[1]["tokens"])

    def no_tokens(eng):
        eng.begin_iteration(case.microbatches, case.mbs, case.seq)

    def loss_before_s(eng):
        begin(eng)
        eng.hand_off(0, mbs[0]["x"].float(), mbs[0]["labels"], None)
        eng.loss(0)

    def unfinished(eng):
        begin(eng)
        eng.end_iteration()

    for name, fn in (("nonlinear", nonlinear), ("out_of_order", out_of_order), ("wrong_ids", wrong_ids),
                     ("no_tokens", no_tokens), ("loss_before_s", loss_before_s), ("unfinished", unfinished)):
        attempt(name, fn)
    return out
