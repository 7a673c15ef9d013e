"""Megatron-Bridge's interleaved schedule at pp=2 against pp=1, next to ours (docs/bridge.md).

Runs the tiny GPT of the CPU checks (:data:`megatron_pp_ext.bridge.multirun.TINY_GPT`, untied
embeddings, no gradient clipping, layout-independent initial weights, 4 iterations) through
Bridge's ``pretrain()`` at pp=1, and at pp=2 and pp=4 with 2 model chunks per rank under Bridge's
own interleaved schedule (its default batched p2p, and the unbatched p2p Megatron-LM requires at
pp=2) and ours; prints each run's logged training and evaluation losses and whether they equal
pp=1's bit for bit. Needs the Bridge venv (scripts/test_bridge.sh makes it); a few minutes on 2 cores::

    .venv-bridge/bin/python -m benchmarks.bridge_interleaved
"""

from __future__ import annotations

import time

from megatron_pp_ext.bridge.multirun import TINY_GPT, bridge_pool, launch

COMMON = list(TINY_GPT) + ["model.share_embeddings_and_output_weights=false", "optimizer.clip_grad=0.0",
                           "train.train_iters=4", "mppx.layout_independent_init"]
VP2 = ["model.virtual_pipeline_model_parallel_size=2"]
UNBATCHED = ["model.overlap_p2p_comm=true", "model.batch_p2p_comm=false"]


def pp(n: int) -> list[str]:
    return [f"model.pipeline_model_parallel_size={n}"]


#: (label, ranks, arguments)
RUNS = [
    ("pp=1", 1, COMMON),
    ("Bridge 1F1B, pp=2", 2, COMMON + pp(2)),
    ("Bridge interleaved, pp=2 (default: batched p2p)", 2, COMMON + pp(2) + VP2),
    ("Bridge interleaved, pp=2, overlap_p2p_comm (unbatched)", 2, COMMON + pp(2) + VP2 + UNBATCHED),
    ("ours interleaved-1f1b, pp=2", 2, COMMON + pp(2) + VP2 + ["mppx.schedule=interleaved-1f1b"]),
    ("ours interleaved-zb, pp=2", 2, COMMON + pp(2) + VP2 + ["mppx.schedule=interleaved-zb"]),
    ("Bridge interleaved, pp=4 (default: batched p2p)", 4, COMMON + pp(4) + VP2),
    ("ours interleaved-zb, pp=4", 4, COMMON + pp(4) + VP2 + ["mppx.schedule=interleaved-zb"]),
]


def _losses(recs: list) -> tuple[list[float], list[float]]:
    last = recs[-1]
    if any(r["exit"] != 0 for r in recs):
        raise RuntimeError(f"a run failed: {[r.get('error') for r in recs]}")
    return ([float.fromhex(d["lm loss"]) for d in last["train"]], [float.fromhex(d["lm loss"]) for d in last["eval"]])


def main() -> None:
    t0 = time.perf_counter()
    rows = []
    with bridge_pool(4, timeout=900) as pool:
        for label, n, argv in RUNS:
            rows.append((label, *_losses(launch(pool, n, argv))))
    ref_train, ref_eval = rows[0][1], rows[0][2]
    print("| run | training loss, iterations 1-4 | validation, test | = pp=1 bit for bit |")
    print("|---|---|---|---|")
    for label, train, ev in rows:
        same = train == ref_train and ev == ref_eval
        print(f"| {label} | {', '.join(f'{v:.7f}' for v in train)} | {', '.join(f'{v:.7f}' for v in ev)} | "
              f"{'yes' if same else 'no'} |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
