import sys

from stack.local import main

sys.exit(main())
