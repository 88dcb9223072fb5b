"""python -m kvdoctor"""
from .cli import main

main()
