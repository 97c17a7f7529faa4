"""Plugins that misbehave, for the tests of how the engine reports them."""
from strata import hookimpl


class BadPicker:
    name = "bad"

    def pick(self, prompt_tokens, slots):
        return (len(slots), 0)  # a slot that does not exist


class BadPickerPlugin:
    @hookimpl
    def strata_slot_picker(self):
        return BadPicker()
