"""`python -m services.common.tinymodel --out DIR`: build the tiny model (see `services.common.tinymodel.build`)."""

from services.common.tinymodel.build import main

main()
