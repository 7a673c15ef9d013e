"""``mppx viz``: draw one schedule (timeline per rank, activation memory beneath)."""

from __future__ import annotations

from ..core import (add_comm_model_argument, add_schedule_arguments, build_from_args, comm_model_of, register_command,
                    simulate_under_model)


def configure(parser):
    add_schedule_arguments(parser, microbatches=8)
    parser.add_argument("-o", "--output", required=True, metavar="FILE.png|svg",
                        help="figure file; the format follows the extension (.png, .svg, .pdf)")
    parser.add_argument("--title", default=None, help="figure title (default: schedule, config and figures)")
    add_comm_model_argument(parser)


def run(args) -> int:
    from ...schedule import schedule_info
    from ...schedule.plots import check_figure_path, check_figure_size, plot_timeline

    check_figure_path(args.output)
    info = schedule_info(args.schedule)
    chunks = info.chunks or args.chunks or 1
    per_rank = args.microbatches * chunks * (3 if info.split_backward else 2)
    check_figure_size(args.pp, per_rank, microbatches=args.microbatches)  # before building anything
    sched, cost = build_from_args(args)
    model = comm_model_of(args)
    under = f" under {model}" if model != "eager" else ""   # (the makespan is the one under this model)
    res = plot_timeline(sched, cost, args.output, title=args.title, result=simulate_under_model(sched, cost, args),
                        title_suffix=under)
    print(f"wrote {args.output} ({sched.name}: pp={sched.num_ranks}, microbatches={sched.num_microbatches}, "
          f"bubble {res.bubble_rate:.1%}, peak {res.max_peak_memory:g} units, makespan {res.makespan:g}"
          + under + ")")
    return 0


register_command("viz", "draw one schedule's timeline and memory curve to a PNG/SVG file", order=40,
                 description="Draw a timeline per rank like the papers' figures (F, B, W, BW coloured, the "
                             "model chunk by shade, the microbatch number in each box) with each rank's "
                             "activation memory beneath.")(configure, run)
