from nnxscale.cli import main

raise SystemExit(main())
