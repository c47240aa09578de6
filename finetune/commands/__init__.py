"""One module per `finetune` subcommand, each with `<name>_command_parser(subparsers)` and `<name>_command(args)`."""
