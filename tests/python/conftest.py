import os
import sys

# Scenario modules live next to the tests; spawned ranks import them by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import boundary_audit  # noqa: E402

boundary_audit.install_if_asked()
