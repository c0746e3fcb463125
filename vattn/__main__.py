from vattn.cli import main

raise SystemExit(main())
