"""Command-line interface (being written)."""


def main(argv=None) -> int:
    raise SystemExit("nnxscale: CLI not written yet")
