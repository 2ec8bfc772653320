import sys

from moed.dev.train.train import main

sys.exit(main())
