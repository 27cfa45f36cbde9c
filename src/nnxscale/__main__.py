from nnxscale.cli import run

run()
