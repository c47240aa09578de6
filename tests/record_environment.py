"""`python -m finetune` that first writes its rank's environment, for the test that a forked launch gives each rank
what a real one gives it (tests/launch/test_warm_launch.py); run it in place of the module:
    accelerate launch --config_file C tests/record_environment.py train recipes/demo.yaml ...

RECORD_ENVIRONMENT=DIR: each rank writes its environment to DIR/rank-R.json before `finetune` starts.
"""

import json
import os
import sys
from pathlib import Path

from finetune.cli import main

folder = Path(os.environ["RECORD_ENVIRONMENT"])
(folder / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(dict(os.environ), indent=1,
                                                                           sort_keys=True))
sys.exit(main(sys.argv[1:]))
