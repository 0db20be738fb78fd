"""Integrations live in the repository's top-level ``integrations/`` folder.

An installed wheel maps them here through ``pyproject.toml``'s ``package-dir``; from a
checkout (``PYTHONPATH=.``, as on the GPU machine) this adds that folder to the
package path so ``graphflow.integrations.dsv4`` imports the same code.
"""

import pathlib

_checkout = pathlib.Path(__file__).resolve().parents[2] / "integrations"
if _checkout.is_dir() and str(_checkout) not in __path__:
    __path__.append(str(_checkout))
