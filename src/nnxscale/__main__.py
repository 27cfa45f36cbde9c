from nnxscale.cli.commands import run

run()
