from kvfleet_cli.main import main

raise SystemExit(main())
