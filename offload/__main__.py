from offload.cli.main import program

program()
