"""What every layer shares and no layer owns: safe files (:mod:`.files`) and the conventions of generation that
training and evaluation must agree on (:mod:`.generation`). Imports nothing of the project."""
