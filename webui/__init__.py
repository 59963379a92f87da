"""What code-sessions asks of the Open WebUI it runs in, in one place: `OpenWebUI` implements engine.Host.
Only here is `open_webui` imported, lazily, so the bundle loads without a running Open WebUI."""

from .files import FilesPublisher
from .host import Locations, Misconfigured, OpenWebUI

__all__ = ["FilesPublisher", "Locations", "Misconfigured", "OpenWebUI"]
