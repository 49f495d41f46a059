"""The error every check of a recipe raises: its message names the key (and the file) and says what would work."""


class RecipeError(ValueError):
    pass
