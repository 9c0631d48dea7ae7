"""The model zoo: real converted models that graphkit must train or refuse clearly."""
