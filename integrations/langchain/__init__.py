"""LangChain chat model for InferCept.

    from infercept.integrations.langchain import ChatInferCept
    model = ChatInferCept()                       # INFERCEPT_BASE_URL or http://127.0.0.1:8000/v1
    agent = create_agent(model, tools=[...], checkpointer=InMemorySaver())
    agent.invoke({"messages": [...]}, {"configurable": {"thread_id": "t1"}})  # thread_id -> session_id
"""
from infercept.integrations.langchain.chat_models import ChatInferCept

__all__ = ["ChatInferCept"]
