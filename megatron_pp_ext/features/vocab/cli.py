"""``mppx compare --vocab-layouts V[,H[,L[,S]]]``: naive placement vs layer redistribution vs
vocabulary parallelism (Algorithm 1 / 2) for a GPT with vocabulary V, hidden size H (3072),
L layers (32) and sequence length S (2048) (torch-free).

::

    mppx compare --vocab-layouts 256000 --pp 8 --microbatches 32
    mppx compare --vocab-layouts 131072,4096,32,4096 --schedules 1f1b,v-half,zbv --json
"""

from __future__ import annotations

import json

__all__ = ["add_compare_arguments", "run_compare", "parse_vocab_layouts", "FLAG"]

DEFAULT_SCHEDULES = "1f1b,v-half"
FLAG = "--vocab-layouts"


def add_compare_arguments(parser) -> None:
    parser.add_argument(FLAG, default=None, metavar="V[,H[,L[,S]]]",
                        help="instead of the schedules alone: naive placement, layer redistribution and vocabulary "
                             "parallelism (Alg. 1/2) of a GPT with vocabulary V, hidden size H (3072), L layers (32), "
                             f"sequence S (2048), on --schedules (default {DEFAULT_SCHEDULES}); costs from the "
                             "model's FLOPs, not --costs")


def parse_vocab_layouts(text: str) -> tuple[int, int, int, int]:
    from ...clibase import CLIError
    parts = [p.strip() for p in str(text).split(",")]
    if not 1 <= len(parts) <= 4:
        raise CLIError(f"{FLAG} {text!r}: give V[,H[,L[,S]]], e.g. 256000 or 131072,4096,32,4096")
    try:
        vals = [int(p.lower().replace("k", "")) * (1024 if p.lower().endswith("k") else 1) for p in parts]
    except ValueError:
        raise CLIError(f"{FLAG} {text!r}: V, H, L, S must be integers (V may end in k), e.g. 256k,3072") from None
    defaults = [None, 3072, 32, 2048]
    vals += defaults[len(vals):]
    if any(v < 1 for v in vals):
        raise CLIError(f"{FLAG} {text!r}: V, H, L, S must be positive")
    return tuple(vals)


def run_compare(args) -> int:
    from ...clibase import CLIError, name_list
    from ...schedule.registry import schedule_names
    from .costs import GPTShape, compare_vocab_layouts, format_rows

    V, H, L, S = parse_vocab_layouts(args.vocab_layouts)
    if L < args.pp * 2:
        raise CLIError(f"{FLAG} {args.vocab_layouts}: {L} layers is fewer than 2 per pipeline rank (--pp {args.pp}), "
                       "which the V schedules need")
    model = getattr(args, "comm_model", None)
    if model not in (None, "eager"):
        raise CLIError(f"{FLAG} compares the layouts' compute and memory; --comm-model {model} would change nothing "
                       "here: drop it, or compare the schedules under it without " + FLAG)
    names = list(name_list(args.schedules, "--schedules", schedule_names(), "schedule")
                 or DEFAULT_SCHEDULES.split(","))
    shape = GPTShape(num_layers=L, hidden=H, vocab=V, seq=S)
    rows = []
    for n in names:
        rows += compare_vocab_layouts(n, shape, args.pp, args.microbatches, chunks=args.chunks or 1)
    if getattr(args, "json", False):
        print(json.dumps({"vocab": V, "hidden": H, "layers": L, "seq": S, "pp": args.pp,
                          "microbatches": args.microbatches, "rows": rows}, indent=2))
        return 0
    print(f"GPT {L} layers, h={H}, V={V}, seq {S}; pp={args.pp}, {args.microbatches} microbatches")
    print()
    print(format_rows(rows))
    print()
    print("naive: embedding on the first stage, output layer + loss on the last; redistribute: layers moved off "
          "those ranks; vocab-1/2: output layer, loss and embedding split over all ranks (Algorithm 1: two "
          "barriers, 2: one). Peak GB: weights + gradients + Adam states + activations.")
    return 0


def _register() -> None:
    from ...extensions import CompareView, register_compare_view
    register_compare_view(CompareView("vocab-layouts", add_compare_arguments,
                                      lambda args: getattr(args, "vocab_layouts", None) is not None, run_compare))


_register()
