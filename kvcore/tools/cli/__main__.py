from kvcore.tools.cli import main

raise SystemExit(main())
