"""`python -m torchscope` runs the CLI."""

from torchscope.cli import main

main()
