import os
import sys

# Scenario modules live next to the tests; spawned ranks import them by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
