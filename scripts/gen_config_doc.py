"""Write docs/configuration.md from the config dataclasses' field comments (rl_tpu/config_doc.py).

.venv/bin/python scripts/gen_config_doc.py           # rewrite the page
.venv/bin/python scripts/gen_config_doc.py --check   # exit 1 when the page is stale
"""

from __future__ import annotations

import argparse
import sys

from rl_tpu import config_doc


def main(argv: list[str] | None = None) -> int:
    """Rewrite or check the page; the exit status is what CI or a maintainer acts on."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = ap.parse_args(argv)
    try:
        if args.check:
            message = config_doc.stale_message()
            if message:
                print(message, file=sys.stderr)
                return 1
            print(f"{config_doc.DOC_PATH} is up to date")
            return 0
        changed = config_doc.write()
    except config_doc.MissingDescription as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{'wrote' if changed else 'unchanged:'} {config_doc.DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
