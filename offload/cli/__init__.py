"""The command line (`offload ...`): every command, the demo included. See `offload.cli.main`."""
