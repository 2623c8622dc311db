"""`lioncub host`: measure this machine's shared devices for the step model (lioncub.apps.train.hostcal) and
write a profile with them, whose forecasts (`simulate step --calibration`, `autotune --calibration`) carry
the interval of the held-out probes."""

from __future__ import annotations

import json

from lioncub.files import check_writable


def register(sub) -> None:
    p = sub.add_parser("host", help="measure this machine's shared cores for the step model (about 40 s)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="ranks that will share this machine (default 4)")
    p.add_argument("--model", default="char-small", help="the run's model (default char-small)")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=8, help="per rank (default 8)")
    p.add_argument("--block-size", dest="block_size", type=int, default=32, help="default 32")
    p.add_argument("--calibration", metavar="FILE",
                   help="the network's calibration to lay the host over (default: the bundled lab's)")
    p.add_argument("--launch", choices=("torchrun", "local"), default="torchrun",
                   help="how the run's ranks start: torchrun (also the lab: each rank in a session "
                        "of its own, a scheduling group of its own where the kernel groups by session) or local "
                        "(`lioncub train --ranks N`: one session); default torchrun")
    p.add_argument("--output", "-o", default="host-calibration.json", help="profile to write")
    p.add_argument("--json", action="store_true", help="print the report (host, held-out residuals) as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from lioncub.simulator.profiles import BackendProfile

    from .hostcal import calibrate_host
    from .loop import TrainConfig

    if args.ranks < 2:
        raise ValueError(f"--ranks must be at least 2 (ranks that share the machine), got {args.ranks}")
    check_writable(args.output, "--output")
    cfg = TrainConfig(model=args.model, batch_size=args.batch_size, block_size=args.block_size)
    base = BackendProfile.load(args.calibration, base="gloo") if args.calibration else None
    profile, rep = calibrate_host(cfg, args.ranks, profile=base, sessions=args.launch == "torchrun")
    profile.save(args.output)
    rep.pop("raw")
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print(f"compute {1e3 * rep['compute_seconds']:.1f} ms per step with {args.ranks} ranks; host "
              + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in rep["host"].items()))
        print("held out: " + ", ".join(f"{k} {v:+.0%}" for k, v in rep["held_out"].items()))
        print(f"forecast interval {rep['forecast_error'][0]:+.0%} .. {rep['forecast_error'][1]:+.0%}; "
              f"wrote {args.output}")
    return 0
