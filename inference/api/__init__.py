"""Code that runs in the api process (under the gateway): admission, the client side of the engine link and the
render queue, input validation and output processing, the structured-output sandbox. Imports ``shared`` and the
library packages, never ``engine`` or ``workers`` (pyproject.toml's import-linter contracts)."""
