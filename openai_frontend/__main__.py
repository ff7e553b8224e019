import sys

from openai_frontend.main import main

sys.exit(main())
