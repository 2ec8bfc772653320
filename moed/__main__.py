from moed.cli import main

raise SystemExit(main())
