"""JSON schemas shared by the response_format tests (engine and server).

``PERSON`` bounds every string, number and array, so even a model with random weights, decoding
greedily under the grammar, must close the object within a few dozen tokens.
"""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
