"""`seer` command line: dispatches `seer <command> [args]` to services.cli.<module>.main(args).

Subcommand modules are imported lazily so `seer rollout` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "model": ("services.cli.model", "prepare or inspect the embedded model (seer model prepare)"),
    "up": ("services.cli.up", "start the whole suite on loopback"),
    "rollout": ("services.cli.rollout", "submit a batch of prompts and print a summary"),
    "profile": ("services.cli.profile", "profile engine step time T(B, gamma) for adaptive speculation"),
    "demo": ("services.cli.demo", "start the suite, run a sample rollout, print the summary, stop"),
}


def usage() -> str:
    lines = ["usage: seer <command> [args]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_m, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage() + "\n")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"seer: unknown command {name!r}\n{usage()}\n")
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
