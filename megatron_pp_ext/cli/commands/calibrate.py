"""``mppx calibrate``: a profiled run's measured stage times -> a ``mppx plan --calibration`` file.

Thin: the conversion lives in :mod:`megatron_pp_ext.planner.calibrate` (torch-free).
"""

from __future__ import annotations

import json
import sys

from ..core import CLIError, register_command, write_text


def configure(parser):
    parser.add_argument("profile", metavar="PROFILE",
                        help="the summary.json of 'mppx train --profile-iters K', or the JSON Megatron-LM writes with "
                             "--pipeline-profile-iters K --pipeline-profile-out FILE")
    parser.add_argument("--out", default="-", metavar="FILE",
                        help="where to write the calibration file ('-': standard output; default)")


def run(args) -> int:
    from ...planner.calibrate import CalibrateError, calibrate_file

    try:
        doc = calibrate_file(args.profile)
    except CalibrateError as e:
        raise CLIError(str(e)) from None
    write_text(args.out, json.dumps(doc, indent=2) + "\n", "--out")
    if args.out != "-":
        st = doc["stage_times"]
        gbps = doc.get("efficiency", {}).get("p2p_gbps")
        sync = doc.get("efficiency", {}).get("exchange_sync_us")
        moe = (f", ep {st['ep']}, etp {st['etp']} (MoE layers: {st['experts']} experts, top-{st['topk']}"
               + (f"; all-to-all {st['a2a_ms']:g} ms of F)" if "a2a_ms" in st else ")")) if "experts" in st else ""
        print(f"wrote {args.out}: stage_times of {st['layers']} layer(s) at micro batch {st['micro_batch_size']}, "
              f"tp {st['tp']}{moe}: F {st['f_ms']:g} ms, B {st['b_ms']:g} ms, W {st['w_ms']:g} ms, "
              f"p2p {st['p2p_ms']:g} ms"
              + (f" ({gbps:g} GB/s)" if gbps else "")
              + (f"; exchange_sync_us {sync:g} (measured)" if sync is not None else "") + f"; precision {doc['precision']} "
              f"(use: mppx plan --calibration {args.out} --precision {doc['precision']} ...)", file=sys.stderr)
    return 0


register_command("calibrate", "turn a profiled run into a planner calibration file", order=65,
                 description="Read the summary.json of 'mppx train --profile-iters K' (or Megatron-LM's "
                             "--pipeline-profile-out JSON) and write a calibration file for 'mppx plan "
                             "--calibration': the measured F/B/W of one stage of transformer layers at the run's "
                             "microbatch size and tp (an MoE run's: of its MoE layers, at its ep and etp, with the "
                             "measured all-to-all), the measured p2p time and link bandwidth, the idle time after a "
                             "synchronised exchange when a GPU measured it, the run's precision and where the "
                             "figures came from.")(configure, run)
