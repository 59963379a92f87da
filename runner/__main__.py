"""`python -m runner doctor [--json]`."""

import sys

from .doctor import main

if __name__ == "__main__":
    if sys.argv[1:2] != ["doctor"]:
        print("usage: python -m runner doctor [--json] [--runsc PATH] [--platform NAME]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))
