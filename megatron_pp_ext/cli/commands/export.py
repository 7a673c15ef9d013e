"""``mppx export``: write one schedule as JSON (this package's format) or as a PyTorch
pipelining CSV (one row per rank, actions such as ``0F3,7I0,7W0``)."""

from __future__ import annotations

import os

from ..core import CLIError, add_schedule_arguments, build_from_args, register_command, write_text

FORMATS = {"json": ".json", "torch-csv": ".csv"}


def configure(parser):
    add_schedule_arguments(parser)
    parser.add_argument("--format", choices=sorted(FORMATS), default=None,
                        help="json (ops, placement, meta; with --with-comm also send/recv ops) or torch-csv "
                             "(torch.distributed.pipelining actions); default: from the -o extension")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="with --with-comm: nccl writes the comm ops as the executor's NCCL path issues "
                             "them (each with its 'stream' and, batched, its 'batch'; meta 'p2p' and "
                             "'recv_wait'); gloo: the tagged point-to-point, no such keys (default: gloo)")
    parser.add_argument("--p2p", choices=("channels", "batched", "pairwise"), default="channels",
                        help="with --backend nccl: the executor's NCCL strategy (default: channels, what it "
                             "runs on GPUs)")
    parser.add_argument("-o", "--output", default="-", metavar="FILE",
                        help="output file ('-' or omitted: standard output)")


def _format(args) -> str:
    if args.format:
        return args.format
    ext = os.path.splitext(args.output)[1].lower()
    for fmt, e in FORMATS.items():
        if ext == e:
            return fmt
    raise CLIError("--format: say which format to write (--format json or --format torch-csv), "
                   "or give -o a .json or .csv file name")


def run(args) -> int:
    fmt = _format(args)
    if fmt == "torch-csv" and args.with_comm:
        raise CLIError("--with-comm applies to --format json only (the torch CSV holds compute actions); "
                       "drop --with-comm or use --format json")
    from ...schedule import export

    if args.backend == "nccl" and not args.with_comm:
        raise CLIError("--backend nccl describes the comm ops: add --with-comm")
    if args.p2p != "channels" and args.backend != "nccl":
        raise CLIError(f"--p2p {args.p2p} is an NCCL strategy: add --backend nccl")
    sched, cost = build_from_args(args)
    model = f"nccl-{args.p2p}" if args.backend == "nccl" else None
    if fmt == "json":
        from ...schedule.simresult import DeadlockError
        try:   # a file that names an NCCL strategy runs under it: checked, not assumed
            text = export.dumps_json(sched, cost, indent=1, comm_model=model)
        except DeadlockError as e:
            raise CLIError(f"--p2p {args.p2p}: {e}; "
                           + ("plain isend/irecv run every message between two ranks on one stream, in issue "
                              "order; " if args.p2p == "pairwise" else "")
                           + "use --p2p channels (the default: what the executor runs on GPUs)") from None
    else:
        text = export.to_torch_csv(sched)
    write_text(args.output, text)
    if args.output != "-":
        print(f"wrote {args.output} ({fmt}: {sched.name}, pp={sched.num_ranks}, "
              f"microbatches={sched.num_microbatches}, {sum(len(o) for o in sched.ops)} ops)")
    return 0


register_command("export", "write one schedule as JSON or as a PyTorch pipelining CSV", order=50,
                 description="Write one schedule to a file: --format json (this package's schedule JSON, "
                             "which megatron_pp_ext.schedule.export.load reads back and validates) or "
                             "--format torch-csv (the action table torch.distributed.pipelining loads).")(configure, run)
