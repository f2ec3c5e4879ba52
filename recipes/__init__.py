"""Named run configurations: modules here define `@temper.config.recipe` functions.

`temper recipes` lists them and `temper train NAME` runs one; see temper/config/recipes.py.
"""
