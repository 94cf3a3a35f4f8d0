"""`python -m simulations simulate ...`: the simulator's command without the `shoal` entry point."""

from simulations.cli import main

raise SystemExit(main())
