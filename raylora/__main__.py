from raylora.cli import main

raise SystemExit(main())
