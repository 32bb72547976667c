import os
import sys


# The rank processes import test helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))
