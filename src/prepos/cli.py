"""`prepos serve | demo | train | calibrate`: each subcommand is a module's main()."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("prepos.server.http.app", "start the HTTP server"),
    "demo": ("prepos.lab.demo", "replay a streaming and an agentic session, print each path"),
    "train": ("prepos.lab.train", "train the bundled model (and its weak contrast)"),
    "calibrate": ("prepos.lab.calibration", "calibrate the confidence gate (risk-coverage)"),
    "bench": ("prepos.lab.bench", "every measurement in one command, then docs/RESULTS.md"),
    "simulate": ("prepos.sim.cli", "closed form and simulator, Figures 4-6, the whole answer"),
}


def usage() -> str:
    lines = ["usage: prepos COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"prepos: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
