"""An image-text model's processor: transformers' own (`AutoProcessor`), or, where its video
half cannot load (transformers' video processors need torchvision, which Conveyor does not
install), the same class over its image processor and tokenizer alone. Conveyor reads images,
not videos, and the processor's image path never touches its video processor."""

from __future__ import annotations

import inspect
from typing import Any


def load_processor(path: str, model_type: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    found = _processor_class(model_type)
    if found is None or is_torchvision_available() or not _takes_videos(found):
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    # None for the video processor, which some (SmolVLM's) require as an argument.
    return images_only(found).from_pretrained(
        path, trust_remote_code=trust_remote_code, video_processor=None
    )


def images_only(processor_class: Any) -> Any:
    """`processor_class` without its video processor (it keeps the class's name, so a folder it
    saves names the real class). Give it `video_processor=None` where the class requires one."""

    class ImagesOnly(processor_class):  # type: ignore[misc]  # a class made at run time
        video_processor = None

        @classmethod
        def get_attributes(cls) -> list[str]:
            return [name for name in super().get_attributes() if "video" not in name]

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_class.__name__
    return ImagesOnly


def _processor_class(model_type: str) -> Any:
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if isinstance(name, str) else None


def _takes_videos(processor_class: Any) -> bool:
    return "video_processor" in inspect.signature(processor_class.__init__).parameters
