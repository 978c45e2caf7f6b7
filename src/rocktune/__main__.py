from rocktune.cli import main

raise SystemExit(main())
