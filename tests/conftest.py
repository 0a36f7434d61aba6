import os
import tempfile

# Keep the tokenised-corpus cache of the test run away from the user's.
os.environ.setdefault("ZOO_CACHE", os.path.join(tempfile.gettempdir(), "zoo-test-cache"))
