"""`python -m otel_train.sink`."""

from __future__ import annotations

import argparse
import sys

from otel_train.sink.cli import DESCRIPTION, add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m otel_train.sink", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
