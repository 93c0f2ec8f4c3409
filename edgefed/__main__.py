from edgefed.cli import main

raise SystemExit(main())
