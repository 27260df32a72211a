"""python -m foxhunt.live: see foxhunt/live/run.py."""

from foxhunt.live.run import main

raise SystemExit(main())
