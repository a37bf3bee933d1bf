from kvcore.cli import main

raise SystemExit(main())
